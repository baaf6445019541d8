package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jetbox-dev/jetbox/internal/testenv"
)

// insertOne commits one outbox row and returns its id.
func (f *fixture) insertOne(conn *pgx.Conn, eventType string) string {
	f.t.Helper()
	var id string
	must(f.t, conn.QueryRow(ctxT(f.t, 30*time.Second), `INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
		VALUES ('order', '1', $1, '{}') RETURNING id::text`, eventType).Scan(&id))
	return id
}

// waitExit waits for jetbox to exit with code and a log holding every want.
func (p *proc) waitExit(code int, want ...string) string {
	p.t.Helper()
	if got := p.wait(time.Minute); got != code {
		p.t.Fatalf("exit %d, want %d:\n%s", got, code, p.tail(4096))
	}
	log := p.logText()
	for _, w := range want {
		if !strings.Contains(log, w) && !strings.Contains(log, strings.ReplaceAll(w, `"`, `\"`)) {
			p.t.Fatalf("log lacks %q:\n%s", w, p.tail(4096))
		}
	}
	return log
}

// TestSchemaChanges: DDL on the outbox under a running jetbox. A column
// added, the optional headers column dropped, the payload retyped to text:
// it keeps forwarding. A needed column renamed, or retyped to a type it
// cannot read: it stops naming the column, confirms nothing past the row,
// and after the documented recovery (point the flag at the new name) the
// row is delivered; nothing is lost or stored twice.
func TestSchemaChanges(t *testing.T) {
	f := newFixture(t)
	o := f.newOracle()
	p := f.start()
	f.waitStreaming(p)
	conn := f.conn()
	f.insertOne(conn, "Before")
	f.pg.Exec(t, "ALTER TABLE outbox ADD COLUMN note text DEFAULT 'x'")
	f.insertOne(conn, "ColumnAdded")
	f.pg.Exec(t, "ALTER TABLE outbox DROP COLUMN headers")
	f.insertOne(conn, "HeadersDropped")
	f.pg.Exec(t, "ALTER TABLE outbox ALTER COLUMN payload TYPE text USING payload::text")
	f.insertOne(conn, "PayloadText")
	f.waitCount(4, 30*time.Second)

	f.pg.Exec(t, "ALTER TABLE outbox RENAME COLUMN event_type TO kind")
	var renamed string
	must(t, conn.QueryRow(ctxT(t, 10*time.Second), `INSERT INTO outbox (aggregate_type, aggregate_id, kind, payload) VALUES ('order', '1', 'Renamed', '{}') RETURNING id::text`).Scan(&renamed))
	p.waitExit(exitFailure, "table-changed", `column "event_type" is missing`, "restore the columns")
	if lsn, _, err := f.slotState(); err != nil || lsn >= o.endLSNOf(renamed) {
		t.Fatalf("slot confirmed to %s past the row (%v)", lsn, err)
	}
	// Recovery: name the new column.
	p = f.start("JETBOX_EVENT_TYPE_COLUMN=kind")
	f.waitCount(5, 30*time.Second)

	f.pg.Exec(t, "ALTER TABLE outbox ALTER COLUMN aggregate_id TYPE int USING 1")
	var retyped string
	must(t, conn.QueryRow(ctxT(t, 10*time.Second), `INSERT INTO outbox (aggregate_type, aggregate_id, kind, payload) VALUES ('order', 7, 'Retyped', '{}') RETURNING id::text`).Scan(&retyped))
	p.waitExit(exitFailure, `column "aggregate_id" is int4, want text`)
	f.pg.Exec(t, "ALTER TABLE outbox ALTER COLUMN aggregate_id TYPE text")
	// The row in the WAL still has the integer column: retyping back does not
	// change it, so jetbox stops on it again.
	p = f.start("JETBOX_EVENT_TYPE_COLUMN=kind")
	log := p.waitExit(exitFailure, `column "aggregate_id" is int4, want text`)
	// The runbook: move the slot past that transaction and re-insert its rows.
	lsn := stoppedLine(t, log)["lsn"].(string)
	f.waitSlotReleased()
	f.pg.Exec(t, "SELECT pg_replication_slot_advance('jetbox', $1::pg_lsn + 1)", lsn)
	f.pg.Exec(t, `WITH gone AS (DELETE FROM outbox WHERE id = $1 RETURNING *)
		INSERT INTO outbox (id, aggregate_type, aggregate_id, kind, payload) SELECT id, aggregate_type, aggregate_id, kind, payload FROM gone`, retyped)
	p = f.start("JETBOX_EVENT_TYPE_COLUMN=kind")
	f.waitCount(6, 30*time.Second)
	want := o.ids()
	want = append(want[:5], want[6:]...) // the skipped insert
	f.assertStream(want)
	p.stop()
}

// TestPublicationChanges: the table taken out of the publication, the table
// dropped and recreated, the publication dropped: each stops jetbox (exit 1)
// with what happened and the fix, instead of silently streaming nothing;
// a restart reports the set-up problem until it is fixed, and once the
// table is back in the publication, that its membership is newer than the
// slot's position (rows committed in between were never streamed) until
// the operator accepts it.
func TestPublicationChanges(t *testing.T) {
	f := newFixture(t)
	fast := "JETBOX_MONITOR_INTERVAL=200ms"
	p := f.start(fast)
	f.waitStreaming(p)
	conn := f.conn()
	f.insertOne(conn, "E")
	f.waitCount(1, 30*time.Second)

	f.pg.Exec(t, "ALTER PUBLICATION jetbox DROP TABLE outbox")
	p.waitExit(exitFailure, `table public.outbox is no longer in publication "jetbox"`, "ALTER PUBLICATION", "re-publish from the table", "jetbox repair --since")
	p = f.start(fast)
	p.waitExit(exitConfig, `publication \"jetbox\" does not contain public.outbox`)
	f.pg.Exec(t, "ALTER PUBLICATION jetbox ADD TABLE outbox")
	p = f.start(fast)
	p.waitExit(exitConfig, `was added to publication \"jetbox\" after the slot's position`, "--accept-lost-rows")

	accept := "JETBOX_ACCEPT_LOST_ROWS=true" // the rows were re-published (the runbook's repair)
	p = f.start(fast, accept)
	f.waitStreaming(p)
	f.pg.Exec(t, "DROP TABLE outbox; "+outboxDDL)
	p.waitExit(exitFailure, "no longer in publication", "dropped and recreated")

	f.pg.Exec(t, "ALTER PUBLICATION jetbox ADD TABLE outbox")
	p = f.start(fast, accept)
	f.waitStreaming(p)
	f.pg.Exec(t, "DROP PUBLICATION jetbox")
	f.insertOne(conn, "AfterDrop")
	p.waitExit(exitFailure, `publication "jetbox"`)
}

// TestTableReplacedWithinMonitorInterval: the outbox dropped, recreated,
// written to, added back to the publication and written to again, all
// within one monitor interval. Postgres never streams the rows written
// before the table was published again; the rows after it arrive under the
// same name with a new relation OID. jetbox stops (exit 1) on that OID,
// before publishing any row of the new table, saying which rows may be
// missing and what to do; after the recovery (restart, re-insert the rows
// with their ids) every row is in the stream once. Replaced with no row
// written yet, the monitor notices the new OID.
func TestTableReplacedWithinMonitorInterval(t *testing.T) {
	f := newFixture(t)
	slow := "JETBOX_MONITOR_INTERVAL=1h" // the monitor must not be what notices
	p := f.start(slow)
	f.waitStreaming(p)
	conn := f.conn()
	first := f.insertOne(conn, "Before")
	f.waitCount(1, 30*time.Second)

	f.pg.Exec(t, "DROP TABLE outbox; "+outboxDDL)
	lost := []string{f.insertOne(conn, "Unpublished1"), f.insertOne(conn, "Unpublished2")}
	f.pg.Exec(t, "ALTER PUBLICATION jetbox ADD TABLE outbox")
	after := []string{f.insertOne(conn, "After1"), f.insertOne(conn, "After2")}
	p.waitExit(exitFailure, "table public.outbox was dropped and recreated", "were never streamed",
		"re-insert, with their ids, the rows of public.outbox committed before", "then restart jetbox")
	f.assertStream([]string{first})

	// Recovery: restart (it goes on from the new table's first streamed
	// transaction), then re-insert the rows that were never streamed. The
	// restart may find the table's membership in the publication newer than
	// the slot's catalog_xmin (it is newer than the rows lost): accepted.
	p = f.start(slow, "JETBOX_ACCEPT_LOST_ROWS=true")
	f.waitCount(3, 30*time.Second)
	f.pg.Exec(t, `WITH gone AS (DELETE FROM outbox WHERE id = ANY($1::uuid[]) RETURNING *)
		INSERT INTO outbox SELECT * FROM gone`, lost)
	f.waitCount(5, 30*time.Second)
	f.assertStream(append(append([]string{first}, after...), lost...))
	if code := p.stop(); code != exitOK {
		t.Fatalf("exit %d", code)
	}

	// Replaced and published again in one transaction, no row written yet:
	// the monitor notices the new OID.
	p = f.start("JETBOX_MONITOR_INTERVAL=200ms")
	f.insertOne(conn, "Streaming") // streamed: the session is open, and has read the OID
	f.waitCount(6, 30*time.Second)
	f.pg.Exec(t, "DROP TABLE outbox; "+outboxDDL+"; ALTER PUBLICATION jetbox ADD TABLE outbox")
	p.waitExit(exitFailure, "table public.outbox was dropped and recreated while jetbox ran, after", "were never streamed", "then restart jetbox")
}

// TestSlotDroppedWhileRunning: an operator terminates jetbox's walsender and
// drops the slot: jetbox stops with exit 1 and says what was lost and what
// to do, rather than silently creating a new slot past the rows.
func TestSlotDroppedWhileRunning(t *testing.T) {
	f := newFixture(t)
	p := f.start()
	f.waitStreaming(p)
	conn := f.conn()
	// jetbox reconnects at once: terminate and drop until the drop wins.
	testenv.WaitFor(t, 30*time.Second, func() error {
		_, err := conn.Exec(ctxT(t, 5*time.Second), `SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE slot_name = 'jetbox' AND active_pid IS NOT NULL`)
		if err != nil {
			return err
		}
		_, err = conn.Exec(ctxT(t, 5*time.Second), `SELECT pg_drop_replication_slot('jetbox')`)
		return err
	})
	p.waitExit(exitFailure, `replication slot \"jetbox\" does not exist`, "re-publish them from the table")
}

// TestStreamChangedWhileRunning: the stream's subjects changed, then the
// stream deleted, under a running jetbox: each stops it (exit 1) with a clear
// error instead of retrying forever; nothing unpublished is confirmed, so
// after a restart (which recreates a deleted stream) the rows committed
// meanwhile are delivered.
func TestStreamChangedWhileRunning(t *testing.T) {
	f := newFixture(t)
	o := f.newOracle()
	p := f.start()
	f.waitStreaming(p)
	conn := f.conn()
	f.insertOne(conn, "First")
	f.waitCount(1, 30*time.Second)
	ctx := ctxT(t, time.Minute)

	st, err := f.js.Stream(ctx, "OUTBOX")
	must(t, err)
	cfg := st.CachedInfo().Config
	cfg.Subjects = []string{"elsewhere.>"}
	_, err = f.js.UpdateStream(ctx, cfg)
	must(t, err)
	f.insertOne(conn, "WhileChanged")
	p.waitExit(exitFailure, "no longer capture", "nats stream edit")
	cfg.Subjects = []string{"outbox.>"}
	_, err = f.js.UpdateStream(ctx, cfg)
	must(t, err)
	p = f.start()
	f.waitCount(2, 30*time.Second)

	must(t, f.js.DeleteStream(ctx, "OUTBOX"))
	lost := f.insertOne(conn, "WhileDeleted")
	p.waitExit(exitFailure, `stream \"OUTBOX\" does not exist`, "restart jetbox")
	p = f.start()
	f.waitCount(1, 30*time.Second)
	got := testenv.ReadStream(t, f.js, "OUTBOX", false)
	if ids := o.ids(); got[0].ID != lost || ids[len(ids)-1] != lost {
		t.Fatalf("recreated stream holds %v, want the row committed while it was gone (%s)", got, lost)
	}
	p.stop()
}

// TestNATSPermissionDenied: a NATS user that may not publish to the outbox
// subjects stops jetbox at once (exit 1) with what to grant, not after
// endless publish timeouts; nothing is confirmed past the row.
func TestNATSPermissionDenied(t *testing.T) {
	if testenv.External() {
		t.Skip("permissions are set on the embedded server")
	}
	f := newFixture(t, withNATS(testenv.WithUser("app", "s3cret"), testenv.WithPublishAllow("$JS.API.>")))
	o := f.newOracle()
	p := f.start("JETBOX_NATS_USER=app", "JETBOX_NATS_PASSWORD=s3cret", "JETBOX_PUBLISH_TIMEOUT=60s")
	f.waitStreaming(p)
	start := time.Now()
	id := f.insertOne(f.conn(), "E")
	p.waitExit(exitFailure, "NATS denies this user publishing to outbox.order.E", "grant publish permission on outbox.>")
	if took := time.Since(start); took > 30*time.Second {
		t.Fatalf("stopped after %s: the permission error waited for the publish timeout", took)
	}
	if lsn, _, err := f.slotState(); err != nil || lsn >= o.endLSNOf(id) {
		t.Fatalf("slot confirmed to %s past the row (%v)", lsn, err)
	}
}

// TestPostgresStandbyRefused: a standby (in recovery) given as the URL is a
// set-up problem (exit 2) naming the fix: before PostgreSQL 16, which
// cannot decode on a standby, the standby itself; from 16, a standby
// without hot_standby_feedback and a physical slot on its primary (every
// missing prerequisite at once).
func TestPostgresStandbyRefused(t *testing.T) {
	f := newFixture(t)
	major := f.pg.Major(t)
	f.pg.Stop("fast")
	signal := filepath.Join(f.pg.DataDir(), "standby.signal")
	must(t, os.WriteFile(signal, nil, 0o600))
	if os.Geteuid() == 0 {
		info, err := os.Stat(f.pg.DataDir())
		must(t, err)
		uid, gid := ownerOf(info)
		must(t, os.Chown(signal, uid, gid))
	}
	f.pg.Start()
	testenv.WaitFor(t, 30*time.Second, func() error {
		c, err := pgx.Connect(context.Background(), f.pg.DSN)
		if err != nil {
			return err
		}
		defer c.Close(context.Background())
		var rec bool
		if err := c.QueryRow(context.Background(), "SELECT pg_is_in_recovery()").Scan(&rec); err != nil || !rec {
			return fmt.Errorf("not in recovery (%v)", err)
		}
		return nil
	})
	p := f.start()
	if major < 16 {
		p.waitExit(exitConfig, "the server is a standby (in recovery)", "logical decoding on a standby needs PostgreSQL 16", "point --postgres-url at the primary")
		return
	}
	p.waitExit(exitConfig, "hot_standby_feedback is off on this standby", "primary_slot_name is empty on this standby", "ALTER SYSTEM SET hot_standby_feedback = on")
}

func ownerOf(info os.FileInfo) (uid, gid int) {
	st := info.Sys().(*syscall.Stat_t)
	return int(st.Uid), int(st.Gid)
}
