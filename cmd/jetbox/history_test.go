package main

import (
	"fmt"
	"net/url"
	"sort"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jetbox-dev/jetbox/internal/testenv"
)

var deliveryModes = []struct{ name, env string }{
	{"dedup", "JETBOX_DELIVERY=dedup"},
	{"exactly-once", "JETBOX_DELIVERY=exactly-once"},
}

// TestRestoredPrimaryRefused: the primary is restored in place from a cold
// copy of its data directory (a disk snapshot) taken before rows that reached
// the stream: same system id and timeline, WAL position behind the stream.
// jetbox refuses to start (exit 2) with the rewind error naming the last
// row's commit time and jetbox repair, in both delivery modes, instead of
// streaming new rows whose positions the stream already holds (exactly-once
// would skip them, silently).
//
// Then jetbox repair replaces the slot and jetbox run goes on: with rows
// committed on the restored server before the repair (they are repaired),
// and with none (the repair stores a baseline marker on
// <prefix>._jetbox.repair so that run resumes on the new slot's history).
func TestRestoredPrimaryRefused(t *testing.T) {
	runsBeside(t)
	for _, tc := range []struct {
		mode   struct{ name, env string }
		missed int
	}{{deliveryModes[0], 2}, {deliveryModes[1], 2}, {deliveryModes[0], 0}, {deliveryModes[1], 0}} {
		mode := tc.mode
		t.Run(fmt.Sprintf("%s/%d rows before the repair", mode.name, tc.missed), func(t *testing.T) {
			f := newFixture(t)
			p := f.start(mode.env)
			f.waitStreaming(p)
			conn := f.conn()
			f.insertTx(conn, "before", 3)
			f.waitCount(3, 30*time.Second)
			p.stop()
			conn.Close(ctxT(t, 5*time.Second))

			f.pg.Stop("fast")
			restore := f.pg.Snapshot(t)
			f.pg.Start()
			p = f.start(mode.env)
			f.waitStreaming(p)
			f.insertTx(f.conn(), "after", 3)
			f.waitCount(6, 30*time.Second)
			last := testenv.ReadStream(t, f.js, "OUTBOX", true)[5]
			p.stop()

			f.pg.Stop("fast")
			restore()
			f.pg.Start()
			p = f.start(mode.env)
			p.waitExit(exitConfig, "rewind:", "is ahead of the server's WAL position", "jetbox repair",
				last.Header.Get("Jetbox-Commit-Time"), last.Header.Get("Jetbox-Commit-LSN"))
			f.waitCount(6, time.Second)

			// The documented way on: jetbox repair (the restored table's rows
			// are all in the stream: it stores a baseline marker), then jetbox
			// run, which must stream the rows committed from now on (exactly-
			// once would skip them if it resumed after the old positions).
			conn = f.conn()
			var missed []string
			if tc.missed > 0 {
				missed = f.insertTx(conn, "restored", tc.missed) // committed before the repair: from the table
			}
			f.repair()
			baseline := 0
			if tc.missed == 0 {
				baseline = 1
			}
			p = f.start(mode.env)
			f.waitStreaming(p)
			fresh := f.insertTx(conn, "fresh", 3)
			f.waitCount(6+baseline+len(missed)+len(fresh), time.Minute)
			if code := p.stop(); code != exitOK {
				t.Fatalf("exit %d:\n%s", code, p.tail(4096))
			}
			msgs := testenv.ReadStream(t, f.js, "OUTBOX", true)
			if baseline == 1 {
				if m := msgs[6]; m.Subject != "outbox._jetbox.repair" || m.Header.Get("Jetbox-Repaired") != "true" {
					t.Fatalf("seq %d on %s: want the repair's baseline marker on outbox._jetbox.repair", m.Seq, m.Subject)
				}
			}
			var got []string
			for _, m := range msgs[6+baseline:] {
				got = append(got, m.ID)
			}
			// The repaired rows come in the repair order (created_at, then id),
			// the streamed ones in commit order.
			sorted := append([]string(nil), missed...)
			sort.Strings(sorted)
			if want := append(sorted, fresh...); fmt.Sprint(got) != fmt.Sprint(want) {
				t.Fatalf("after the repair the stream holds %v, want the rows committed on the restored server %v", got, want)
			}
			for i, m := range msgs[6+baseline:] {
				if repaired := m.Header.Get("Jetbox-Repaired") == "true"; repaired != (i < len(missed)) {
					t.Fatalf("seq %d: Jetbox-Repaired %v: only the rows committed before the repair are marked", m.Seq, repaired)
				}
			}
		})
	}
}

// TestLostSlotRefused: the slot is dropped while jetbox is stopped and the
// stream holds jetbox messages from this database: jetbox refuses to create
// a new slot past the rows committed meanwhile (exit 2, the lost-slot error
// naming jetbox repair); with --accept-lost-rows it creates one and goes on.
func TestLostSlotRefused(t *testing.T) {
	for _, mode := range deliveryModes {
		t.Run(mode.name, func(t *testing.T) {
			f := newFixture(t)
			p := f.start(mode.env)
			f.waitStreaming(p)
			conn := f.conn()
			ids := f.insertTx(conn, "kept", 3)
			f.waitCount(3, 30*time.Second)
			p.stop()
			f.waitSlotReleased()
			f.pg.Exec(t, "SELECT pg_drop_replication_slot('jetbox')")
			f.insertTx(conn, "lost", 2)

			p = f.start(mode.env)
			last := testenv.ReadStream(t, f.js, "OUTBOX", true)[2]
			p.waitExit(exitConfig, "lost-slot:", `replication slot "jetbox" does not exist`, "jetbox repair", "--accept-lost-rows",
				last.Header.Get("Jetbox-Commit-Time"), last.Header.Get("Jetbox-Commit-LSN"))
			if _, _, err := f.slotState(); err == nil {
				t.Fatal("jetbox created a slot although it refused to start")
			}

			p = f.start(mode.env, "JETBOX_ACCEPT_LOST_ROWS=true")
			f.waitStreaming(p)
			ids = append(ids, f.insertTx(conn, "new", 2)...)
			f.waitCount(5, 30*time.Second)
			f.assertStream(ids)
			if code := p.stop(); code != exitOK {
				t.Fatalf("exit %d:\n%s", code, p.tail(4096))
			}
		})
	}
}

// TestRestoredPrimaryWrittenPastTheTip: the primary is restored in place
// and applications commit rows before jetbox starts again, so many that the
// server's WAL position passes the stream's last one: the rewind check at
// session open passes, and the slot would stream the new rows at positions
// the stream holds (exactly-once skipped them as replays, and confirmed
// them). jetbox must refuse (exit 2, rewind: the slot's replay does not
// reproduce the stream's last message), jetbox repair must replace the slot
// and publish the new rows, and jetbox run then go on: every row of the
// restored server in the stream, once.
func TestRestoredPrimaryWrittenPastTheTip(t *testing.T) {
	for _, mode := range deliveryModes {
		t.Run(mode.name, func(t *testing.T) {
			f := newFixture(t)
			p := f.start(mode.env)
			f.waitStreaming(p)
			conn := f.conn()
			f.insertTx(conn, "before", 3)
			f.waitCount(3, 30*time.Second)
			p.stop()
			conn.Close(ctxT(t, 5*time.Second))

			f.pg.Stop("fast")
			restore := f.pg.Snapshot(t)
			f.pg.Start()
			p = f.start(mode.env)
			f.waitStreaming(p)
			f.insertTx(f.conn(), "after", 3)
			f.waitCount(6, 30*time.Second)
			last := testenv.ReadStream(t, f.js, "OUTBOX", true)[5]
			p.stop()

			f.pg.Stop("fast")
			restore()
			f.pg.Start()
			conn = f.conn()
			tipLSN, err := pglogrepl.ParseLSN(last.Header.Get("Jetbox-Commit-LSN"))
			if err != nil {
				t.Fatal(err)
			}
			// One row per transaction until the server's position is past
			// the tip: rows before and after the tip's position.
			var restored []string
			for len(restored) < 200 {
				restored = append(restored, f.insertTx(conn, "restored", 1)...)
				var pos string
				if err := conn.QueryRow(ctxT(t, 5*time.Second), "SELECT pg_current_wal_lsn()::text").Scan(&pos); err != nil {
					t.Fatal(err)
				}
				if lsn, _ := pglogrepl.ParseLSN(pos); lsn > tipLSN+0x400 && len(restored) >= 5 {
					break
				}
			}
			p = f.start(mode.env)
			p.waitExit(exitConfig, "rewind:", "does not reproduce", "jetbox repair")
			f.waitCount(6, time.Second)

			f.repair()
			p = f.start(mode.env)
			f.waitStreaming(p)
			fresh := f.insertTx(conn, "fresh", 3)
			f.waitCount(6+len(restored)+len(fresh), time.Minute)
			if code := p.stop(); code != exitOK {
				t.Fatalf("exit %d:\n%s", code, p.tail(4096))
			}
			var got []string
			for _, m := range testenv.ReadStream(t, f.js, "OUTBOX", true)[6:] {
				got = append(got, m.ID)
			}
			if want := append(append([]string(nil), restored...), fresh...); fmt.Sprint(got) != fmt.Sprint(want) {
				t.Fatalf("after the repair the stream holds %v, want the restored server's rows %v then %v", got, restored, fresh)
			}
		})
	}
}

// TestLostSlotRefusedBesideAnotherDatabase: two databases of one cluster
// forward to one stream on one prefix (dedup mode), one of them named with
// a '/'. The stream's last message is the other database's when a slot is
// lost: jetbox must still find its own database's last message and refuse
// to create a slot past the rows committed meanwhile (the tip was the last
// message on the prefix, whoever wrote it, and a '/' in the database's name
// disabled every history check).
func TestLostSlotRefusedBesideAnotherDatabase(t *testing.T) {
	f := newFixture(t)
	f.pg.Exec(t, `CREATE DATABASE "app/two"`)
	u, err := url.Parse(f.pgURL)
	if err != nil {
		t.Fatal(err)
	}
	u.Path, u.RawPath = "/app/two", "/"+url.PathEscape("app/two")
	two := []string{"JETBOX_POSTGRES_URL=" + u.String(), "JETBOX_SLOT=jetbox_two", "JETBOX_DELIVERY=dedup"}
	ctx := ctxT(t, 30*time.Second)
	conn2, err := pgx.Connect(ctx, u.String())
	if err != nil {
		t.Fatal(err)
	}
	defer conn2.Close(ctx)
	if _, err := conn2.Exec(ctx, outboxDDL); err != nil {
		t.Fatal(err)
	}
	conn := f.conn()

	// Each database streams a transaction; "app/two" writes last.
	p := f.start("JETBOX_DELIVERY=dedup")
	f.waitStreaming(p)
	f.insertTx(conn, "one", 2)
	f.waitCount(2, 30*time.Second)
	p.stop()
	p2 := f.start(two...)
	waitSlotActive(t, conn, "jetbox_two", true)
	f.insertTx(conn2, "two", 2)
	f.waitCount(4, 30*time.Second)
	p2.stop()

	for _, c := range []struct {
		name string
		env  []string
		conn *pgx.Conn
		slot string
	}{{"the database that did not write last", []string{"JETBOX_DELIVERY=dedup"}, conn, "jetbox"}, {"a database named with a slash", two, conn2, "jetbox_two"}} {
		t.Run(c.name, func(t *testing.T) {
			waitSlotActive(t, conn, c.slot, false)
			f.pg.Exec(t, "SELECT pg_drop_replication_slot($1)", c.slot)
			f.insertTx(c.conn, "lost", 1)
			p := f.start(c.env...)
			p.waitExit(exitConfig, "lost-slot:", fmt.Sprintf("replication slot %q does not exist", c.slot), "jetbox repair")
			var n int
			if err := conn.QueryRow(ctxT(t, 5*time.Second), "SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1", c.slot).Scan(&n); err != nil || n != 0 {
				t.Fatalf("jetbox created slot %s (%d, %v) although it refused to start", c.slot, n, err)
			}
		})
	}
}

// waitSlotActive waits until a walsender holds slot (active) or none does.
func waitSlotActive(t *testing.T, conn *pgx.Conn, slot string, active bool) {
	t.Helper()
	testenv.WaitFor(t, time.Minute, func() error {
		var got bool
		err := conn.QueryRow(ctxT(t, 5*time.Second), `SELECT EXISTS (SELECT 1 FROM pg_replication_slots s JOIN pg_stat_replication r ON r.pid = s.active_pid WHERE s.slot_name = $1)`, slot).Scan(&got)
		if err != nil {
			return err
		}
		if got != active {
			return fmt.Errorf("slot %s active %v, want %v", slot, got, active)
		}
		return nil
	})
}
