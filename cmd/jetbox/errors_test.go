package main

import (
	"bytes"
	"fmt"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/jetbox-dev/jetbox/internal/testenv"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// TestConfigProblemsReportedTogether: every bad flag in one run, exit 2.
func TestConfigProblemsReportedTogether(t *testing.T) {
	var out, errOut bytes.Buffer
	code := realMain([]string{"run", "--nats-url=http://x", "--table=a.b.c", "--slot=Bad-Slot", "--stream=a.b",
		"--subject-prefix=out box", "--max-in-flight=0", "--publish-timeout=soon", "--payload-column=id",
		"--order-guard=maybe", "--log-format=xml", "--on-invalid=later"}, &out, &errOut)
	if code != exitConfig {
		t.Fatalf("exit %d, want %d", code, exitConfig)
	}
	for _, want := range []string{"--postgres-url (JETBOX_POSTGRES_URL): required", "--nats-url", "--table", "--slot", "--stream",
		"--subject-prefix", "--max-in-flight", "--publish-timeout", "--payload-column", "--order-guard", "--log-format", "--on-invalid", "fix:"} {
		if !strings.Contains(plainLog(errOut.String()), want) {
			t.Errorf("output lacks %q:\n%s", want, plainLog(errOut.String()))
		}
	}
	// Conflicting options, each named with its fix.
	errOut.Reset()
	code = realMain([]string{"run", "--postgres-url=postgres://x@127.0.0.1/db", "--order-guard=false",
		"--dead-letter-subject=outbox._dlq"}, &out, &errOut)
	for _, want := range []string{"conflicts with --delivery=exactly-once (the default)", "add --delivery=dedup", "set while --on-invalid=stop"} {
		if code != exitConfig || !strings.Contains(plainLog(errOut.String()), want) {
			t.Errorf("exit %d, output lacks %q:\n%s", code, want, plainLog(errOut.String()))
		}
	}
	errOut.Reset()
	code = realMain([]string{"run", "--postgres-url=postgres://x@127.0.0.1/db", "--on-invalid=dead-letter", "--dead-letter-subject=outbox.order"}, &out, &errOut)
	if code != exitConfig || !strings.Contains(plainLog(errOut.String()), "collide with aggregate type order") {
		t.Errorf("dead-letter subject among the event subjects: exit %d:\n%s", code, plainLog(errOut.String()))
	}
	if code := realMain([]string{"run", "--no-such-flag"}, &out, &errOut); code != exitConfig {
		t.Fatalf("unknown flag: exit %d", code)
	}
	t.Setenv("JETBOX_STATUS_INTERVAL", "forever")
	errOut.Reset()
	if code := realMain([]string{"run", "--postgres-url=postgres://x@127.0.0.1/db"}, &out, &errOut); code != exitConfig ||
		!strings.Contains(plainLog(errOut.String()), "JETBOX_STATUS_INTERVAL") {
		t.Fatalf("env var not validated: %d %s", code, plainLog(errOut.String()))
	}
}

// TestSetupProblemsReportedTogether: a missing table and a stream whose
// subjects do not capture the prefix are reported in one run, exit 2, and
// nothing is created on the Postgres side.
func TestSetupProblemsReportedTogether(t *testing.T) {
	f := newFixture(t, withDDL("SELECT 1"), withPG(testenv.WithSetting("wal_level", "replica")))
	_, err := f.js.CreateStream(ctxT(t, 10*time.Second), jetstream.StreamConfig{Name: "OUTBOX", Subjects: []string{"elsewhere.>"}})
	must(t, err)
	p := f.start()
	if code := p.wait(time.Minute); code != exitConfig {
		t.Fatalf("exit %d, want %d:\n%s", code, exitConfig, p.logText())
	}
	log := p.logText()
	for _, want := range []string{"3 set-up problem(s)", `wal_level is \"replica\"`, "table public.outbox does not exist",
		`do not capture \"outbox.>\"`} {
		if !strings.Contains(log, want) && !strings.Contains(log, strings.ReplaceAll(want, `\"`, `"`)) {
			t.Errorf("output lacks %q:\n%s", want, log)
		}
	}
	var slots int
	must(t, f.conn().QueryRow(ctxT(t, 5*time.Second), "SELECT count(*) FROM pg_replication_slots").Scan(&slots))
	if slots != 0 {
		t.Fatalf("a slot was created despite set-up problems")
	}
}

// TestCustomColumns: other column names, a text id and a bytea payload.
func TestCustomColumns(t *testing.T) {
	f := newFixture(t, withDDL(`CREATE SCHEMA app; CREATE TABLE app.events (
		event_id text PRIMARY KEY, kind text NOT NULL, key text NOT NULL, name text NOT NULL, body bytea NOT NULL)`))
	p := f.start("JETBOX_TABLE=app.events", "JETBOX_ID_COLUMN=event_id", "JETBOX_AGGREGATE_TYPE_COLUMN=kind",
		"JETBOX_AGGREGATE_ID_COLUMN=key", "JETBOX_EVENT_TYPE_COLUMN=name", "JETBOX_PAYLOAD_COLUMN=body", "JETBOX_HEADERS_COLUMN=",
		"JETBOX_SUBJECT_PREFIX=acme.events", "JETBOX_STREAM=EVENTS")
	f.waitStreaming(p)
	body := []byte{0, 1, 2, 0xff, '\n', '\\'}
	f.pg.Exec(t, "INSERT INTO app.events VALUES ('ev-1', 'invoice', 'inv-9', 'Issued', $1)", body)
	testenv.WaitFor(t, 30*time.Second, func() error {
		n, err := testenv.StreamCount(f.js, "EVENTS")
		if err != nil || n != 1 {
			return fmt.Errorf("%d messages (%v)", n, err)
		}
		return nil
	})
	msgs := testenv.ReadStream(t, f.js, "EVENTS", true)
	if m := msgs[0]; m.ID != "ev-1" || m.Subject != "acme.events.invoice.Issued" || !bytes.Equal(m.Data, body) {
		t.Fatalf("got id %q subject %q data %q", m.ID, m.Subject, m.Data)
	}
	p.stop()
}

// TestBadRowStops: a row that cannot be published stops jetbox with an error
// naming the row id, its transaction LSN and the fix; the slot is not
// confirmed past it, and a restart stops on it again (nothing skipped).
func TestBadRowStops(t *testing.T) {
	for _, c := range []struct {
		name, insert, want, fix string
	}{
		{"invalid subject token", `INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) VALUES ('big order', '1', 'E', '{}') RETURNING id::text`,
			"aggregate_type", "must each be one NATS subject token"},
		{"over max_payload", `INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) VALUES ('order', '1', 'E', jsonb_build_object('pad', repeat('x', 20000))) RETURNING id::text`,
			"max_payload", "raise max_payload"},
		{"non-string header", `INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, headers) VALUES ('order', '1', 'E', '{}', '{"retries": 3}') RETURNING id::text`,
			`header \"retries\" is a number`, "--on-invalid=dead-letter"},
		// The outbox was cleaned up and a producer re-used an id still inside
		// the duplicate window: JetStream would drop the row silently.
		{"repeated id", `WITH gone AS (DELETE FROM outbox WHERE id = (SELECT id FROM outbox ORDER BY created_at LIMIT 1) RETURNING id)
			INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) SELECT id, 'order', '3', 'E', '{}' FROM gone RETURNING id::text`,
			"duplicate window", "unique id"},
	} {
		t.Run(c.name, func(t *testing.T) {
			f := newFixture(t, withNATS(testenv.WithMaxPayload(16*1024)))
			o := f.newOracle()
			p := f.start()
			f.waitStreaming(p)
			conn := f.conn()
			good := f.insertTx(conn, "good", 2)
			f.waitCount(2, 30*time.Second)

			ctx := ctxT(t, time.Minute)
			tx, err := conn.Begin(ctx)
			must(t, err)
			var first, bad string
			must(t, tx.QueryRow(ctx, `INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) VALUES ('order', '2', 'E', '{}') RETURNING id::text`).Scan(&first))
			must(t, tx.QueryRow(ctx, c.insert).Scan(&bad))
			must(t, tx.Commit(ctx))
			badEnd := o.endLSNOf(bad)

			for run := 0; run < 2; run++ {
				if code := p.wait(time.Minute); code != exitFailure {
					t.Fatalf("run %d: exit %d, want %d", run, code, exitFailure)
				}
				log := p.logText()
				for _, want := range []string{bad, c.want, c.fix, "transaction 0/"} {
					if !strings.Contains(log, want) {
						t.Fatalf("run %d: log lacks %q:\n%s", run, want, p.tail(3000))
					}
				}
				lsn, _, err := f.slotState()
				must(t, err)
				if lsn >= badEnd {
					t.Fatalf("slot confirmed to %s, past the bad row's transaction (ends %s)", lsn, badEnd)
				}
				if run == 0 {
					p = f.start() // the operator restarts without a fix: it stops again
				}
			}
			// Nothing after the bad row was published, and nothing was lost
			// before it (the first row of its transaction may be there).
			got := testenv.ReadStream(t, f.js, "OUTBOX", false)
			if len(got) < 2 || got[0].ID != good[0] || got[1].ID != good[1] || len(got) > 3 || (len(got) == 3 && got[2].ID != first) {
				t.Fatalf("stream %+v", got)
			}
		})
	}
}

// TestNATSBehindClosingProxyIsUnreachable: a listener that accepts and
// closes (NATS down behind a load balancer) is "unreachable" (retried),
// not a credentials problem (exit 2).
func TestNATSBehindClosingProxyIsUnreachable(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	must(t, err)
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			c.Close()
		}
	}()
	_, err = nats.Connect("nats://"+ln.Addr().String(), nats.Timeout(2*time.Second))
	if err == nil || !natsUnreachable(err) {
		t.Fatalf("connect error %v: not classified as unreachable", err)
	}
	if natsUnreachable(nats.ErrAuthorization) {
		t.Fatal("an authorization failure classified as unreachable")
	}
}
