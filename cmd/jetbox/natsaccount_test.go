package main

import (
	"bytes"
	"os"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jetbox-dev/jetbox/internal/testenv"
	"github.com/nats-io/nats.go"
)

// TestNATSInboxPrefixAndDomain: an account that may subscribe only under
// its own inbox prefix is served with --nats-inbox-prefix, and a server
// whose JetStream has a domain through its API ($JS.hub.API) with
// --nats-js-domain (another domain fails the set-up checks: the flag is
// used); rows arrive, and the connection is named
// jetbox/<slot>/<hostname>. The same settings from a nats context work too.
func TestNATSInboxPrefixAndDomain(t *testing.T) {
	f := newFixture(t, withNATS(testenv.WithUser("app", "s3cret"), testenv.WithJetStreamDomain("hub"),
		testenv.WithSubscribeAllow("_INBOX_jetbox.>")))
	// The account's limit is real: the default inbox is refused.
	nc, err := nats.Connect(f.natURL, nats.UserInfo("app", "s3cret"))
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	if _, err := nc.Request("$JS.API.INFO", nil, 2*time.Second); err == nil {
		t.Fatal("the account got a reply on _INBOX: the test would not test the inbox prefix")
	}
	creds := []string{"JETBOX_NATS_USER=app", "JETBOX_NATS_PASSWORD=s3cret", "JETBOX_NATS_INBOX_PREFIX=_INBOX_jetbox"}
	var out bytes.Buffer
	check := exec.Command(jetboxBin, "check", "--postgres-url="+f.pgURL, "--nats-url="+f.natURL, "--nats-js-domain=elsewhere")
	check.Env, check.Stdout, check.Stderr = append(os.Environ(), creds...), &out, &out
	if err := check.Run(); err == nil || !strings.Contains(out.String(), "JetStream") {
		t.Fatalf("jetbox check with another domain: %v, want the JetStream API unreachable:\n%s", err, out.String())
	}
	p := f.start(append(creds, "JETBOX_NATS_JS_DOMAIN=hub")...)
	f.waitStreaming(p)
	ids := f.insertTx(f.conn(), "a-1", 3)
	f.waitCount(3, time.Minute)
	host, _ := os.Hostname()
	if names := f.nats.ConnectionNames(t); !slices.Contains(names, "jetbox/jetbox/"+host) {
		t.Fatalf("connections %q, want one named jetbox/jetbox/%s", names, host)
	}
	if code := p.stop(); code != exitOK {
		t.Fatalf("exit %d: %s", code, p.tail(2048))
	}

	// From a nats context: inbox_prefix and jetstream_domain.
	dir := t.TempDir()
	ctxFile := dir + "/hub.json"
	if err := os.WriteFile(ctxFile, []byte(`{"url": "`+f.natURL+`", "user": "app", "password": "s3cret", "inbox_prefix": "_INBOX_jetbox", "jetstream_domain": "hub"}`), 0o600); err != nil {
		t.Fatal(err)
	}
	p = f.start("JETBOX_NATS_CONTEXT="+ctxFile, "JETBOX_NATS_URL=")
	f.waitStreaming(p)
	ids = append(ids, f.insertTx(f.conn(), "a-2", 2)...)
	f.waitCount(5, time.Minute)
	f.assertStream(ids)
	if code := p.stop(); code != exitOK {
		t.Fatalf("exit %d: %s", code, p.tail(2048))
	}
}
