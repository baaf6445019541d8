package main

import (
	"bytes"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jetbox-dev/jetbox/internal/testenv"
)

// waitStored waits for n messages in the stream, failing at once when
// jetbox exits meanwhile.
func (f *fixture) waitStored(p *proc, n int) []testenv.StreamMsg {
	f.t.Helper()
	testenv.WaitFor(f.t, 30*time.Second, func() error {
		select {
		case <-p.done:
			f.t.Fatalf("jetbox exited with %d:\n%s", p.code, p.tail(4096))
		default:
		}
		got, err := testenv.StreamCount(f.js, "OUTBOX")
		if err != nil || got != uint64(n) {
			return fmt.Errorf("%d messages, want %d (%v)", got, n, err)
		}
		return nil
	})
	return testenv.ReadStream(f.t, f.js, "OUTBOX", true)
}

// checkCmd runs jetbox check against the fixture and wants exit code and
// an output holding every want.
func (f *fixture) checkCmd(code int, want ...string) string {
	f.t.Helper()
	var out, errOut bytes.Buffer
	if got := realMain([]string{"check", "--postgres-url=" + f.pg.DSN, "--nats-url=" + f.nats.URL}, &out, &errOut); got != code {
		f.t.Fatalf("jetbox check: exit %d, want %d:\n%s%s", got, code, out.String(), errOut.String())
	}
	for _, w := range want {
		if !strings.Contains(out.String(), w) {
			f.t.Fatalf("jetbox check output lacks %q:\n%s", w, out.String())
		}
	}
	return out.String()
}

func (f *fixture) serverVersion() int {
	f.t.Helper()
	var num int
	must(f.t, f.conn().QueryRow(ctxT(f.t, 5*time.Second), "SELECT current_setting('server_version_num')::int").Scan(&num))
	return num
}

// TestDomainColumns: outbox columns declared with domains (over text, over
// another domain, over jsonb) pass check and repair's column check, and
// stream: pgoutput names them by the domain's OID, which jetbox reads as
// the base type.
func TestDomainColumns(t *testing.T) {
	f := newFixture(t, withDDL(`CREATE DOMAIN agg_t AS text CHECK (VALUE <> '');
		CREATE DOMAIN agg_id_t AS agg_t;
		CREATE DOMAIN payload_t AS jsonb;
		CREATE TABLE public.outbox (
		  id uuid PRIMARY KEY DEFAULT gen_random_uuid(), aggregate_type agg_t NOT NULL, aggregate_id agg_id_t NOT NULL,
		  event_type text NOT NULL, payload payload_t NOT NULL, headers jsonb, created_at timestamptz NOT NULL DEFAULT now())`))
	f.checkCmd(exitOK, "fits the outbox contract")
	dry := f.startCmd([]string{"repair", "--dry-run"})
	if code := dry.wait(time.Minute); code != exitOK {
		t.Fatalf("repair --dry-run: exit %d:\n%s", code, dry.tail(4096))
	}
	p := f.start()
	f.waitStreaming(p)
	conn := f.conn()
	ids := []string{f.insertOne(conn, "Created"), f.insertOne(conn, "Paid")}
	msgs := f.waitStored(p, 2)
	for i, m := range msgs {
		if m.ID != ids[i] || m.Subject != "outbox.order."+[]string{"Created", "Paid"}[i] || string(m.Data) != "{}" || m.Header.Get("Jetbox-Aggregate-Id") != "1" {
			t.Fatalf("message %d: %+v", i, m)
		}
	}
	if code := p.stop(); code != exitOK {
		t.Fatalf("exit %d", code)
	}
}

// TestCharColumns: char(n) aggregate type, aggregate id and event type
// arrive space-padded; jetbox publishes them trimmed (subject and headers).
func TestCharColumns(t *testing.T) {
	f := newFixture(t, withDDL(`CREATE TABLE public.outbox (
		  id uuid PRIMARY KEY DEFAULT gen_random_uuid(), aggregate_type char(12) NOT NULL, aggregate_id char(8) NOT NULL,
		  event_type char(24) NOT NULL, payload jsonb NOT NULL, headers jsonb, created_at timestamptz NOT NULL DEFAULT now())`))
	f.checkCmd(exitOK, "fits the outbox contract")
	p := f.start()
	f.waitStreaming(p)
	id := f.insertOne(f.conn(), "Created")
	m := f.waitStored(p, 1)[0]
	if m.ID != id || m.Subject != "outbox.order.Created" || m.Header.Get("Jetbox-Aggregate-Type") != "order" ||
		m.Header.Get("Jetbox-Aggregate-Id") != "1" || m.Header.Get("Jetbox-Event-Type") != "Created" {
		t.Fatalf("message: %+v", m)
	}
	if code := p.stop(); code != exitOK {
		t.Fatalf("exit %d", code)
	}
}

// TestGeneratedEventType: a generated event_type. Before PostgreSQL 18
// pgoutput never sends generated columns: check, run (with the other set-up
// problems, exit 2, nothing created) and repair refuse the table with the
// fix, which then works. On 18 the publication jetbox creates publishes
// them (publish_generated_columns = stored) and the rows stream; a
// publication that does not is refused with the ALTER PUBLICATION fix.
func TestGeneratedEventType(t *testing.T) {
	f := newFixture(t, withDDL(`CREATE TABLE public.outbox (
		  id uuid PRIMARY KEY DEFAULT gen_random_uuid(), aggregate_type text NOT NULL, aggregate_id text NOT NULL,
		  event_type text GENERATED ALWAYS AS (aggregate_type || 'Changed') STORED,
		  payload jsonb NOT NULL, headers jsonb, created_at timestamptz NOT NULL DEFAULT now())`))
	insert := func() string {
		var id string
		must(t, f.conn().QueryRow(ctxT(t, 10*time.Second), `INSERT INTO outbox (aggregate_type, aggregate_id, payload)
			VALUES ('order', '1', '{}') RETURNING id::text`).Scan(&id))
		return id
	}
	if f.serverVersion() >= 180000 {
		f.checkCmd(exitOK, "publish_generated_columns = stored")
		p := f.start()
		f.waitStreaming(p)
		id := insert()
		if m := f.waitStored(p, 1)[0]; m.ID != id || m.Subject != "outbox.order.orderChanged" {
			t.Fatalf("message: %+v", m)
		}
		if code := p.stop(); code != exitOK {
			t.Fatalf("exit %d", code)
		}
		f.waitSlotReleased()
		f.pg.Exec(t, "ALTER PUBLICATION jetbox SET (publish_generated_columns = none)")
		fix := `ALTER PUBLICATION "jetbox" SET (publish_generated_columns = stored)`
		f.checkCmd(exitConfig, `publication "jetbox" does not publish generated columns`, fix)
		f.start().waitExit(exitConfig, "set-up problem", "does not publish generated columns", fix)
		return
	}
	const problem, fix = `column "event_type" is a generated column: pgoutput before PostgreSQL 18 never sends generated columns`,
		`ALTER TABLE "public"."outbox" ALTER COLUMN "event_type" DROP EXPRESSION`
	f.checkCmd(exitConfig, problem, fix)
	f.start().waitExit(exitConfig, "set-up problem", problem, fix)
	var slots int
	must(t, f.conn().QueryRow(ctxT(t, 5*time.Second), "SELECT count(*) FROM pg_replication_slots").Scan(&slots))
	if slots != 0 {
		t.Fatalf("a slot was created despite the set-up problem")
	}
	dry := f.startCmd([]string{"repair", "--dry-run"})
	if code := dry.wait(time.Minute); code == exitOK || !strings.Contains(dry.logText(), problem) {
		t.Fatalf("repair --dry-run: exit %d:\n%s", code, dry.tail(4096))
	}
	// The fix: a plain column (here filled by a trigger) streams.
	f.pg.Exec(t, `ALTER TABLE outbox ALTER COLUMN event_type DROP EXPRESSION;
		CREATE FUNCTION outbox_event_type() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN NEW.event_type := NEW.aggregate_type || 'Changed'; RETURN NEW; END $$;
		CREATE TRIGGER outbox_event_type BEFORE INSERT ON outbox FOR EACH ROW EXECUTE FUNCTION outbox_event_type()`)
	f.checkCmd(exitOK, "fits the outbox contract")
	p := f.start()
	f.waitStreaming(p)
	id := insert()
	if m := f.waitStored(p, 1)[0]; m.ID != id || m.Subject != "outbox.order.orderChanged" {
		t.Fatalf("message: %+v", m)
	}
	if code := p.stop(); code != exitOK {
		t.Fatalf("exit %d", code)
	}
}
