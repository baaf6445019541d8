package main

import (
	"net/url"
	"os"
	"strconv"
	"strings"

	"github.com/alecthomas/kong"
	"github.com/nats-io/jsm.go/natscontext"
	"github.com/nats-io/nats.go"
)

// natsFlags are the NATS connection settings of RunFlags after
// --nats-context: each one from its flag when given, else from the context.
type natsFlags struct {
	URL, Creds, NKey, User, Password, Token string
	TLSCA, TLSCert, TLSKey                  string
	TLSFirst                                bool
	InboxPrefix, JSDomain                   string
	UserJWT, UserSeed                       string          // a context's user_jwt and user_seed
	fromContext                             map[string]bool // flag name → its value came from the context
}

// natsContextFix is the hint for a context that cannot be used.
const natsContextFix = "name a context of `nats context ls` (a file $XDG_CONFIG_HOME/nats/context/NAME.json, by default under ~/.config), or give the path of a context file"

// natsFlags merges f's NATS flags with --nats-context. Explicit flags override
// the context; a flag of another credential kind than the context's is a
// conflict, reported through bad with the other configuration problems.
func (f *RunFlags) natsFlags(bad func(flag, value, problem, fix string)) natsFlags {
	n := natsFlags{URL: f.NatsURL, Creds: f.NatsCreds, NKey: f.NatsNKey, User: f.NatsUser, Password: f.NatsPassword,
		Token: f.NatsToken, TLSCA: f.NatsTLSCA, TLSCert: f.NatsTLSCert, TLSKey: f.NatsTLSKey,
		InboxPrefix: f.NatsInboxPrefix, JSDomain: f.NatsJSDomain, fromContext: map[string]bool{}}
	if f.NatsContext == "" {
		return n
	}
	if n.URL == "" { // until the context gives its own: no second problem when it cannot
		n.URL = nats.DefaultURL
	}
	ctxBad := func(problem, fix string) { bad("nats-context", f.NatsContext, problem, fix) }
	nc, err := loadNATSContext(f.NatsContext)
	if err != nil {
		ctxBad("cannot load the nats context: "+err.Error(), natsContextFix)
		return n
	}
	if f.NatsURL == "embedded" {
		ctxBad("given with --nats-url=embedded, which connects to its own server", "drop --nats-context, or give a NATS URL")
		return n
	}
	for _, u := range []struct{ setting, value string }{
		{"jetstream_api_prefix", nc.JSAPIPrefix()}, {"socks_proxy", nc.SocksProxy()}, {"windows_cert_store", nc.WindowsCertStore()},
	} {
		if u.value != "" {
			ctxBad("the context sets "+u.setting+", which jetbox does not support", "use a context without it, or the --nats-* flags")
		}
	}

	// The context's values, by the flag they stand for.
	ctxVal := map[string]string{"nats-creds": nc.Creds(), "nats-nkey": nc.NKey(), "nats-user": nc.User(),
		"nats-password": nc.Password(), "nats-token": nc.Token(), "nats-tls-ca": nc.CA(), "nats-tls-cert": nc.Certificate(),
		"nats-tls-key": nc.Key(), "nats-inbox-prefix": nc.InboxPrefix(), "nats-js-domain": nc.JSDomain()}
	refused := false
	for flag, v := range ctxVal {
		file := !plainValueFlags[flag]
		switch s := refScheme(v); {
		case s == "file" && file:
			ctxVal[flag] = strings.TrimPrefix(v, "file://")
		case s != "" && (file || resolverSchemes[s]):
			ctxBad("the context's "+strings.TrimPrefix(flag, "nats-")+" is a "+s+":// reference; jetbox reads files and plain values",
				"put the value (or the file's path) in the context, or give --"+flag)
			refused = true
		}
	}
	if refused {
		return n
	}

	kind := func(creds, nkey, user, password, token string) (kinds []string) {
		for _, k := range []struct {
			name string
			set  bool
		}{{"creds", creds != ""}, {"nkey", nkey != ""}, {"user/password", user != "" || password != ""}, {"token", token != ""}} {
			if k.set {
				kinds = append(kinds, k.name)
			}
		}
		return kinds
	}
	ctxKinds := kind(ctxVal["nats-creds"], ctxVal["nats-nkey"], ctxVal["nats-user"], ctxVal["nats-password"], ctxVal["nats-token"])
	if nc.UserJWT() != "" || nc.UserSeed() != "" {
		ctxKinds = append(ctxKinds, "user_jwt/user_seed")
	}
	flagKinds := kind(f.NatsCreds, f.NatsNKey, f.NatsUser, f.NatsPassword, f.NatsToken)
	take := func(flag string, dst *string) {
		if *dst == "" && ctxVal[flag] != "" {
			*dst, n.fromContext[flag] = ctxVal[flag], true
		}
	}
	switch {
	case len(ctxKinds) > 1:
		ctxBad("the context sets more than one credential kind ("+strings.Join(ctxKinds, ", ")+")", "keep one of them in the context")
	case len(ctxKinds) == 1 && len(flagKinds) == 1 && ctxKinds[0] != flagKinds[0]:
		flag := map[string]string{"creds": "nats-creds", "nkey": "nats-nkey", "user/password": "nats-user", "token": "nats-token"}[flagKinds[0]]
		bad(flag, "", "a "+flagKinds[0]+" credential, while --nats-context "+f.NatsContext+" authenticates with "+ctxKinds[0],
			"give the context's kind of credential (the flag then overrides the context's), or drop the flag or --nats-context")
	case len(ctxKinds) == 1 && len(flagKinds) <= 1: // the same kind, or none given: flags override field by field
		take("nats-creds", &n.Creds)
		take("nats-nkey", &n.NKey)
		take("nats-user", &n.User)
		take("nats-password", &n.Password)
		take("nats-token", &n.Token)
		if len(flagKinds) == 0 {
			n.UserJWT, n.UserSeed = nc.UserJWT(), nc.UserSeed()
		}
	}
	take("nats-inbox-prefix", &n.InboxPrefix)
	take("nats-js-domain", &n.JSDomain)
	take("nats-tls-ca", &n.TLSCA)
	if f.NatsTLSCert == "" && f.NatsTLSKey == "" { // a pair: from the flags or from the context
		take("nats-tls-cert", &n.TLSCert)
		take("nats-tls-key", &n.TLSKey)
	}
	n.TLSFirst = nc.TLSHandshakeFirst()
	if f.NatsURL == "" { // not given (see clearDefaultNatsURL)
		n.URL, n.fromContext["nats-url"] = nc.ServerURL(), true
	}
	return n
}

// plainValueFlags are the context settings that are values, not files.
var plainValueFlags = map[string]bool{"nats-user": true, "nats-password": true, "nats-token": true, "nats-inbox-prefix": true, "nats-js-domain": true}

// resolverSchemes are the reference schemes natscontext resolves in a
// context's secrets (env://, op://, nsc://, data:, file://); other values
// are literal.
var resolverSchemes = map[string]bool{"env": true, "op": true, "nsc": true, "data": true, "file": true}

// refScheme is the URI scheme of a context value, "" for a plain path or value.
func refScheme(v string) string {
	u, err := url.Parse(v)
	if err != nil || len(u.Scheme) < 2 {
		return ""
	}
	return u.Scheme
}

// loadNATSContext reads a nats CLI context: a name (a file under
// $XDG_CONFIG_HOME/nats/context) or the path of a context file.
func loadNATSContext(name string) (*natscontext.Context, error) {
	if strings.ContainsRune(name, os.PathSeparator) || strings.HasSuffix(name, ".json") {
		return natscontext.NewFromFile(name)
	}
	return natscontext.New(name, true)
}

// clearDefaultNatsURL runs once the flags are parsed: with --nats-context
// and no --nats-url (nor JETBOX_NATS_URL) it clears the URL kong set to its
// default, so that the context's URL applies. A given --nats-url, even the
// default one, overrides the context's.
func (f *RunFlags) clearDefaultNatsURL(kctx *kong.Context) {
	if f.NatsContext == "" {
		return
	}
	if _, env := os.LookupEnv("JETBOX_NATS_URL"); env {
		return
	}
	for _, p := range kctx.Path {
		if p.Flag != nil && p.Flag.Name == "nats-url" {
			return
		}
	}
	f.NatsURL = ""
}

// connectionName is the NATS connection name of an instance reading slot:
// jetbox/<slot>/<hostname>, so `nats server report connections` tells
// instances apart.
func connectionName(slot string) string {
	host, err := os.Hostname()
	if err != nil || host == "" {
		host = "unknown-host"
	}
	return "jetbox/" + slot + "/" + host
}

// checkNATSNames reports an inbox prefix or a JetStream domain the server
// would refuse (given as a flag or in the context).
func checkNATSNames(n natsFlags, context string, bad func(flag, value, problem, fix string)) {
	report := func(flag, value, problem, fix string) {
		if n.fromContext[flag] {
			bad("nats-context", context, "its "+strings.TrimPrefix(flag, "nats-")+" "+strconv.Quote(value)+": "+problem, fix)
			return
		}
		bad(flag, value, problem, fix)
	}
	if p := n.InboxPrefix; p != "" && !validSubject(p) {
		report("nats-inbox-prefix", p, "not a subject without wildcards", "use dot-separated tokens without spaces, * or >, e.g. _INBOX_jetbox")
	}
	if d := n.JSDomain; d != "" && (strings.Contains(d, ".") || !validSubject(d)) {
		report("nats-js-domain", d, "not a single subject token", "use the domain name of the server's jetstream block, e.g. hub")
	}
}

// validSubject reports whether s is a subject of non-empty tokens without
// wildcards or whitespace.
func validSubject(s string) bool {
	for _, tok := range strings.Split(s, ".") {
		if tok == "" || tok == "*" || tok == ">" || strings.ContainsAny(tok, " \t\r\n*>") {
			return false
		}
	}
	return true
}
