package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/jetbox-dev/jetbox/internal/check"
	"github.com/jetbox-dev/jetbox/internal/testenv"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// TestNATSTLSAndPassword: a NATS server that requires TLS with client
// certificates and a user/password; jetbox verifies the server with a custom
// CA, presents its certificate, authenticates and forwards. A wrong password
// is a set-up problem (exit 2) that never shows the password.
func TestNATSTLSAndPassword(t *testing.T) {
	certs := testenv.NewCerts(t)
	f := &fixture{t: t, pg: testenv.StartPostgres(t),
		nats: testenv.StartNATS(t, testenv.WithTLS(certs.ServerTLS), testenv.WithUser("jetbox", "n4ts-s3cret"))}
	f.pgURL, f.natURL = f.pg.DSN, f.nats.URL
	f.env = []string{"JETBOX_HTTP_ADDR=", "JETBOX_NATS_TLS_CA=" + certs.CAFile, "JETBOX_NATS_TLS_CERT=" + certs.ClientCert,
		"JETBOX_NATS_TLS_KEY=" + certs.ClientKey, "JETBOX_NATS_USER=jetbox"}
	f.pg.Exec(t, outboxDDL)
	nc, err := nats.Connect(f.nats.URL, nats.RootCAs(certs.CAFile), nats.ClientCert(certs.ClientCert, certs.ClientKey), nats.UserInfo("jetbox", "n4ts-s3cret"))
	must(t, err)
	defer nc.Close()
	f.js, err = jetstream.New(nc)
	must(t, err)

	bad := f.start("JETBOX_NATS_PASSWORD=wrong-pa55")
	if code := bad.wait(time.Minute); code != exitConfig {
		t.Fatalf("wrong NATS password: exit %d, want %d:\n%s", code, exitConfig, bad.logText())
	}
	if log := bad.logText(); !strings.Contains(log, "nats.connect") || !strings.Contains(strings.ToLower(log), "authorization") || strings.Contains(log, "wrong-pa55") {
		t.Fatalf("wrong password not reported clearly (or the password leaked):\n%s", log)
	}
	noTLS := f.start("JETBOX_NATS_PASSWORD=n4ts-s3cret", "JETBOX_NATS_TLS_CERT=", "JETBOX_NATS_TLS_KEY=")
	if code := noTLS.wait(time.Minute); code != exitConfig {
		t.Fatalf("missing client certificate: exit %d:\n%s", code, noTLS.logText())
	}

	f.forwardsWithoutLeaking(f.start("JETBOX_NATS_PASSWORD=n4ts-s3cret"), "n4ts-s3cret", 5)
}

// forwardsWithoutLeaking checks p forwards n rows and its log never shows secret.
func (f *fixture) forwardsWithoutLeaking(p *proc, secret string, n int) {
	f.t.Helper()
	f.waitStreaming(p)
	want := f.insertTx(f.conn(), "secure", n)
	f.waitCount(n, 30*time.Second)
	f.assertStream(want)
	p.stop()
	if strings.Contains(p.logText(), secret) {
		f.t.Fatalf("the password %q appears in jetbox's log", secret)
	}
}

// TestPostgresPasswordNeverLogged: with password authentication, a wrong
// password is reported (exit 2) without the password; a right one works and
// never appears in the log either.
func TestPostgresPasswordNeverLogged(t *testing.T) {
	f := newFixture(t)
	f.pg.Exec(t, "CREATE ROLE forwarder LOGIN REPLICATION PASSWORD 'pg-s3cret-pw'")
	f.pg.Exec(t, "ALTER TABLE outbox OWNER TO forwarder")
	f.pg.Exec(t, "GRANT CREATE ON DATABASE postgres TO forwarder")
	hba := filepath.Join(f.pg.DataDir(), "pg_hba.conf")
	old, err := os.ReadFile(hba)
	must(t, err)
	must(t, os.WriteFile(hba, append([]byte("host all forwarder 127.0.0.1/32 scram-sha-256\nhost replication forwarder 127.0.0.1/32 scram-sha-256\n"), old...), 0o600))
	f.pg.Exec(t, "SELECT pg_reload_conf()")

	base := fmt.Sprintf("postgres://forwarder:%%s@127.0.0.1:%d/postgres?sslmode=disable", f.pg.Port())
	f.pgURL = fmt.Sprintf(base, "wrong-pg-pw")
	bad := f.start()
	if code := bad.wait(time.Minute); code != exitConfig {
		t.Fatalf("wrong Postgres password: exit %d:\n%s", code, bad.logText())
	}
	if log := bad.logText(); !strings.Contains(log, "password authentication failed") || strings.Contains(log, "wrong-pg-pw") {
		t.Fatalf("wrong password not reported clearly (or leaked):\n%s", log)
	}
	f.pgURL = fmt.Sprintf(base, "pg-s3cret-pw")
	f.forwardsWithoutLeaking(f.start(), "pg-s3cret-pw", 3)
}

// TestCheckCommand: `jetbox check` reports every problem of both sides in one
// run, with fixes, changes nothing, and exits 2; --json is machine-readable;
// on a good set-up it exits 0 and lists what `run` would create.
func TestCheckCommand(t *testing.T) {
	f := newFixture(t, withDDL(`CREATE TABLE public.outbox (id bigint, aggregate_type text, event_type text, payload xml)`))
	_, err := f.js.CreateStream(ctxT(t, 10*time.Second), jetstream.StreamConfig{Name: "OUTBOX", Subjects: []string{"elsewhere.>"}, Duplicates: time.Minute})
	must(t, err)
	var out, errOut bytes.Buffer
	args := []string{"check", "--postgres-url=" + f.pg.DSN, "--nats-url=" + f.nats.URL, "--max-outage=10m"}
	if code := realMain(args, &out, &errOut); code != exitConfig {
		t.Fatalf("exit %d:\n%s%s", code, out.String(), plainLog(errOut.String()))
	}
	text := out.String()
	t.Logf("jetbox check output:\n%s", text)
	for _, want := range []string{`column "id" is int8`, `column "aggregate_id" is missing`, `column "payload" is xml`,
		`do not capture "outbox.>"`, `also captures ["elsewhere.>"]`, "--delivery=dedup", "1 replica", "fix:", "problem(s) to fix"} {
		if !strings.Contains(text, want) {
			t.Errorf("check output lacks %q:\n%s", want, text)
		}
	}
	// The duplicate window matters in dedup mode only.
	out.Reset()
	if code := realMain(append(args, "--delivery=dedup"), &out, &errOut); code != exitConfig || !strings.Contains(out.String(), "duplicate window 1m0s is shorter than --max-outage 10m0s") {
		t.Errorf("dedup mode: exit %d, no duplicate-window warning:\n%s", code, out.String())
	}
	var slots int
	must(t, f.conn().QueryRow(ctxT(t, 5*time.Second), "SELECT count(*) FROM pg_replication_slots").Scan(&slots))
	if slots != 0 {
		t.Fatal("check created a slot")
	}

	// A fitting set-up: exit 0, JSON, and the missing pieces marked create.
	f.pg.Exec(t, "DROP TABLE outbox")
	f.pg.Exec(t, outboxDDL)
	must(t, f.js.DeleteStream(ctxT(t, 10*time.Second), "OUTBOX"))
	out.Reset()
	if code := realMain(append(args, "--json", "--duplicate-window=30m"), &out, &errOut); code != exitOK {
		t.Fatalf("exit %d:\n%s", code, out.String())
	}
	var res struct {
		OK       bool            `json:"ok"`
		Findings []check.Finding `json:"findings"`
	}
	must(t, json.Unmarshal(out.Bytes(), &res))
	creates := map[string]bool{}
	for _, fd := range res.Findings {
		if fd.Severity == check.Create {
			creates[fd.Check] = true
		}
	}
	if !res.OK || !creates["postgres.publication"] || !creates["postgres.slot"] || !creates["nats.stream"] {
		t.Fatalf("JSON result %+v", res)
	}
}

// TestSlotInvalidated: a slot invalidated by max_slot_wal_keep_size (WAL it
// needed is gone) stops jetbox with an explanation and the recovery steps; it
// is neither dropped nor recreated.
func TestSlotInvalidated(t *testing.T) {
	f := newFixture(t, withPG(testenv.WithSetting("max_slot_wal_keep_size", "1MB"), testenv.WithSetting("max_wal_size", "32MB"), testenv.WithSetting("min_wal_size", "32MB")))
	p := f.start()
	f.waitStreaming(p)
	conn := f.conn()
	f.insertTx(conn, "a", 1)
	f.waitCount(1, 30*time.Second)
	p.stop()
	ctx := ctxT(t, 3*time.Minute)
	testenv.WaitFor(t, 2*time.Minute, func() error {
		var status string
		if err := conn.QueryRow(ctx, "SELECT coalesce(wal_status, '') FROM pg_replication_slots WHERE slot_name = 'jetbox'").Scan(&status); err != nil {
			return err
		}
		if status == "lost" {
			return nil
		}
		// Write WAL past the slot's allowance and let a checkpoint remove it.
		for _, sql := range []string{"INSERT INTO other (note) SELECT repeat('x', 1000) FROM generate_series(1, 3000)", "SELECT pg_switch_wal()", "CHECKPOINT"} {
			if _, err := conn.Exec(ctx, sql); err != nil {
				return err
			}
		}
		return fmt.Errorf("wal_status %q", status)
	})
	p = f.start()
	if code := p.wait(time.Minute); code != exitConfig && code != exitFailure {
		t.Fatalf("exit %d on an invalidated slot:\n%s", code, p.logText())
	}
	if log := p.logText(); !strings.Contains(log, "invalidated") || !strings.Contains(log, "re-publish") {
		t.Fatalf("no explanation:\n%s", p.tail(3000))
	}
	var n int
	must(t, conn.QueryRow(ctx, "SELECT count(*) FROM pg_replication_slots WHERE slot_name = 'jetbox' AND wal_status = 'lost'").Scan(&n))
	if n != 1 {
		t.Fatal("the invalidated slot was dropped or recreated")
	}
}

// TestStatusCommand: `jetbox status` shows the slot, publication and stream.
func TestStatusCommand(t *testing.T) {
	f := newFixture(t)
	p := f.start()
	f.waitStreaming(p)
	f.insertTx(f.conn(), "s", 3)
	f.waitCount(3, 30*time.Second)
	var out, errOut bytes.Buffer
	if code := realMain([]string{"status", "--postgres-url=" + f.pg.DSN, "--nats-url=" + f.nats.URL}, &out, &errOut); code != exitOK {
		t.Fatalf("exit %d:\n%s%s", code, out.String(), plainLog(errOut.String()))
	}
	for _, want := range []string{"slot         jetbox: active, walsender pid", "publication  jetbox: inserts true", "stream       OUTBOX: 3 messages", "duplicate window 30m0s"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("status lacks %q:\n%s", want, out.String())
		}
	}
	p.stop()
}
