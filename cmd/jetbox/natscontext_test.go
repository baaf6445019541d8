package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/jetbox-dev/jetbox/internal/testenv"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// writeNATSContext writes a nats CLI context NAME.json under dir (an
// XDG_CONFIG_HOME) and returns its path.
func writeNATSContext(t *testing.T, dir, name string, settings map[string]any) string {
	t.Helper()
	b, err := json.Marshal(settings)
	must(t, err)
	path := filepath.Join(dir, "nats", "context", name+".json")
	must(t, os.MkdirAll(filepath.Dir(path), 0o700))
	must(t, os.WriteFile(path, b, 0o600))
	return path
}

// parseRun parses `jetbox run` args as main does (the kong hooks included)
// and returns the configuration, or the problems.
func parseRun(t *testing.T, args ...string) (Config, []*ConfigError) {
	t.Helper()
	var c cli
	exitCode := -1
	var stderr strings.Builder
	parser, err := newParser(&c, discard{}, &stderr, &exitCode)
	must(t, err)
	if kctx, code := parseCommand(parser, &exitCode, append([]string{"run", "--postgres-url=postgres://u@127.0.0.1/db"}, args...), &stderr); kctx == nil {
		t.Fatalf("parse %v: exit %d: %s", args, code, stderr.String())
	}
	cfg, err := c.Run.Config()
	var list []*ConfigError
	if j, ok := err.(interface{ Unwrap() []error }); ok {
		for _, e := range j.Unwrap() {
			var ce *ConfigError
			if !errors.As(e, &ce) {
				t.Fatalf("%v is not a *ConfigError", e)
			}
			list = append(list, ce)
		}
	} else if err != nil {
		t.Fatalf("Config: %v is not joined ConfigErrors", err)
	}
	return cfg, list
}

// TestNATSContextFlags: --nats-context fills the NATS settings from a nats
// CLI context; each flag given (or JETBOX_* variable) overrides the context's
// value; a credential of another kind than the context's, a context that is
// missing or unreadable, a file it names that is missing, or a setting jetbox
// cannot honour are ConfigErrors reported with the other problems.
func TestNATSContextFlags(t *testing.T) {
	xdg := t.TempDir()
	t.Setenv("XDG_CONFIG_HOME", xdg)
	for _, kv := range os.Environ() {
		if name, _, _ := strings.Cut(kv, "="); strings.HasPrefix(name, "JETBOX_") {
			t.Setenv(name, "")
			os.Unsetenv(name)
		}
	}
	files := t.TempDir()
	file := func(name string) string {
		p := filepath.Join(files, name)
		must(t, os.WriteFile(p, []byte("x"), 0o600))
		return p
	}
	ca, cert, key, creds := file("ca.pem"), file("cert.pem"), file("key.pem"), file("u.creds")
	writeNATSContext(t, xdg, "pw", map[string]any{"url": "nats://ctx.example:4222", "user": "app", "password": "ctx-pw",
		"ca": ca, "cert": "file://" + cert, "key": key, "tls_first": true})
	writeNATSContext(t, xdg, "creds", map[string]any{"url": "tls://a.example:4222,tls://b.example:4222", "creds": creds})
	writeNATSContext(t, xdg, "gone", map[string]any{"creds": filepath.Join(files, "missing.creds")})
	writeNATSContext(t, xdg, "domain", map[string]any{"token": "t", "jetstream_domain": "hub", "inbox_prefix": "_INBOX_app"})
	writeNATSContext(t, xdg, "baddomain", map[string]any{"token": "t", "jetstream_domain": "a.b"})
	writeNATSContext(t, xdg, "apiprefix", map[string]any{"token": "t", "jetstream_api_prefix": "$JS.x.API"})
	writeNATSContext(t, xdg, "envref", map[string]any{"user": "app", "password": "env://NATS_PW"})
	writeNATSContext(t, xdg, "two", map[string]any{"user": "app", "password": "p", "nkey": key})
	bad := filepath.Join(xdg, "nats", "context", "broken.json")
	must(t, os.WriteFile(bad, []byte("{not json"), 0o600))
	must(t, os.MkdirAll(filepath.Join(xdg, "nats", "context", "adir.json"), 0o700))

	// The context alone.
	cfg, errs := parseRun(t, "--nats-context=pw")
	if len(errs) > 0 {
		t.Fatalf("context pw: %v", errs)
	}
	want := NATSAuth{User: "app", Password: "ctx-pw", TLSCA: ca, TLSCert: cert, TLSKey: key, TLSFirst: true, Name: connectionName("jetbox")}
	if cfg.NatsURL != "nats://ctx.example:4222" || cfg.NATS != want {
		t.Fatalf("context pw: url %q, auth %+v; want the context's %+v", cfg.NatsURL, cfg.NATS, want)
	}
	// Flags override, field by field; a given --nats-url wins even when it is the default.
	cfg, errs = parseRun(t, "--nats-context=pw", "--nats-url=nats://127.0.0.1:4222", "--nats-password=flag-pw", "--nats-tls-ca="+cert)
	if len(errs) > 0 || cfg.NatsURL != "nats://127.0.0.1:4222" || cfg.NATS.User != "app" || cfg.NATS.Password != "flag-pw" || cfg.NATS.TLSCA != cert || cfg.NATS.TLSKey != key {
		t.Fatalf("overrides: url %q, auth %+v, errors %v", cfg.NatsURL, cfg.NATS, errs)
	}
	t.Setenv("JETBOX_NATS_URL", "nats://env.example:4222")
	t.Setenv("JETBOX_NATS_CONTEXT", "creds")
	if cfg, errs = parseRun(t); len(errs) > 0 || cfg.NatsURL != "nats://env.example:4222" || cfg.NATS.Creds != creds {
		t.Fatalf("JETBOX_NATS_CONTEXT with JETBOX_NATS_URL: url %q, auth %+v, errors %v", cfg.NatsURL, cfg.NATS, errs)
	}
	os.Unsetenv("JETBOX_NATS_URL")
	if cfg, errs = parseRun(t); len(errs) > 0 || cfg.NatsURL != "tls://a.example:4222,tls://b.example:4222" {
		t.Fatalf("JETBOX_NATS_CONTEXT: url %q, errors %v", cfg.NatsURL, errs)
	}
	os.Unsetenv("JETBOX_NATS_CONTEXT")
	// A context file by path.
	if cfg, errs = parseRun(t, "--nats-context="+filepath.Join(xdg, "nats", "context", "creds.json")); len(errs) > 0 || cfg.NATS.Creds != creds {
		t.Fatalf("context by path: auth %+v, errors %v", cfg.NATS, errs)
	}
	// Without --nats-context nothing changes.
	// A domain and an inbox prefix from the context.
	if cfg, errs = parseRun(t, "--nats-context=domain"); len(errs) > 0 || cfg.Sink.JSDomain != "hub" || cfg.NATS.InboxPrefix != "_INBOX_app" || cfg.NATS.Token != "t" {
		t.Fatalf("context domain: domain %q, auth %+v, errors %v", cfg.Sink.JSDomain, cfg.NATS, errs)
	}
	if cfg, errs = parseRun(t, "--nats-context=domain", "--nats-js-domain=leaf", "--nats-inbox-prefix=_INBOX_flag"); len(errs) > 0 || cfg.Sink.JSDomain != "leaf" || cfg.NATS.InboxPrefix != "_INBOX_flag" {
		t.Fatalf("flags over the context's domain: domain %q, auth %+v, errors %v", cfg.Sink.JSDomain, cfg.NATS, errs)
	}
	if cfg, errs = parseRun(t); len(errs) > 0 || cfg.NatsURL != nats.DefaultURL || cfg.NATS != (NATSAuth{Name: connectionName("jetbox")}) {
		t.Fatalf("no context: url %q, auth %+v, errors %v", cfg.NatsURL, cfg.NATS, errs)
	}

	for _, c := range []struct {
		args       []string
		flag, text string
	}{
		{[]string{"--nats-context=creds", "--nats-token=s3cret"}, "nats-token", "authenticates with creds"},
		{[]string{"--nats-context=pw", "--nats-creds=" + creds}, "nats-creds", "authenticates with user/password"},
		{[]string{"--nats-context=nosuch"}, "nats-context", "cannot load"},
		{[]string{"--nats-context=broken"}, "nats-context", "cannot load"},
		{[]string{"--nats-context=adir"}, "nats-context", "cannot load"},
		{[]string{"--nats-context=gone"}, "nats-context", "its creds file"},
		{[]string{"--nats-context=apiprefix"}, "nats-context", "jetstream_api_prefix"},
		{[]string{"--nats-context=baddomain"}, "nats-context", "js-domain \"a.b\": not a single subject token"},
		{[]string{"--nats-js-domain=a b"}, "nats-js-domain", "not a single subject token"},
		{[]string{"--nats-inbox-prefix=_INBOX.*"}, "nats-inbox-prefix", "not a subject without wildcards"},
		{[]string{"--nats-context=envref"}, "nats-context", "env:// reference"},
		{[]string{"--nats-context=two"}, "nats-context", "more than one credential kind"},
		{[]string{"--nats-context=pw", "--nats-url=embedded", "--nats-store-dir=" + files}, "nats-context", "embedded"},
	} {
		_, errs := parseRun(t, append(c.args, "--slot=Bad-Slot")...)
		var found, slot bool
		for _, e := range errs {
			found = found || (e.Flag == c.flag && e.Env == envName(c.flag) && strings.Contains(e.Error(), c.text) && e.Hint != "")
			slot = slot || e.Flag == "slot"
		}
		if !found || !slot || len(errs) != 2 {
			t.Errorf("%v: want a --%s problem saying %q beside the --slot one, and no other, got %v", c.args, c.flag, c.text, errs)
		}
	}
}

// TestNATSContext: against a NATS server that requires TLS with client
// certificates and a user/password, a nats CLI context carrying the URL,
// the user, the password and the TLS files is all jetbox needs: check passes
// and run forwards. A flag overrides the context's value (a wrong
// --nats-password is refused by the server), and check reports a flag of
// another credential kind as a configuration problem.
func TestNATSContext(t *testing.T) {
	certs := testenv.NewCerts(t)
	const password = "ctx-n4ts-s3cret"
	f := &fixture{t: t, pg: testenv.StartPostgres(t),
		nats: testenv.StartNATS(t, testenv.WithTLS(certs.ServerTLS), testenv.WithUser("jetbox", password))}
	f.pg.Exec(t, outboxDDL)
	nc, err := nats.Connect(f.nats.URL, nats.RootCAs(certs.CAFile), nats.ClientCert(certs.ClientCert, certs.ClientKey), nats.UserInfo("jetbox", password))
	must(t, err)
	defer nc.Close()
	f.js, err = jetstream.New(nc)
	must(t, err)

	xdg := t.TempDir()
	writeNATSContext(t, xdg, "prod", map[string]any{"url": f.nats.URL, "user": "jetbox", "password": password,
		"ca": certs.CAFile, "cert": certs.ClientCert, "key": certs.ClientKey})
	t.Setenv("XDG_CONFIG_HOME", xdg)

	var out, errOut bytes.Buffer
	args := []string{"check", "--postgres-url=" + f.pg.DSN, "--nats-context=prod", "--duplicate-window=30m"}
	if code := realMain(args, &out, &errOut); code != exitOK {
		t.Fatalf("check with the context: exit %d:\n%s%s", code, out.String(), plainLog(errOut.String()))
	}
	out.Reset()
	errOut.Reset()
	if code := realMain(append(args, "--nats-password=wrong-pa55"), &out, &errOut); code != exitConfig ||
		!strings.Contains(strings.ToLower(out.String()+plainLog(errOut.String())), "authorization") {
		t.Fatalf("check with the context and a wrong --nats-password: exit %d, want %d and an authorization error:\n%s%s", code, exitConfig, out.String(), plainLog(errOut.String()))
	}
	out.Reset()
	errOut.Reset()
	if code := realMain(append(args, "--nats-token=tok"), &out, &errOut); code != exitConfig ||
		!strings.Contains(plainLog(errOut.String()), "--nats-token (JETBOX_NATS_TOKEN): a token credential, while --nats-context prod authenticates with user/password") {
		t.Fatalf("check with the context and --nats-token: exit %d, want %d and the conflict:\n%s%s", code, exitConfig, out.String(), plainLog(errOut.String()))
	}

	// run: the context's URL applies where JETBOX_NATS_URL is empty.
	f.pgURL, f.natURL = f.pg.DSN, ""
	f.env = []string{"JETBOX_HTTP_ADDR=", "JETBOX_DUPLICATE_WINDOW=30m", "XDG_CONFIG_HOME=" + xdg, "JETBOX_NATS_CONTEXT=prod"}
	f.forwardsWithoutLeaking(f.start(), password, 5)
}
