package main

import (
	"testing"
	"time"

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
func TestRestoredPrimaryRefused(t *testing.T) {
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
			p = f.start(mode.env)
			p.waitExit(exitConfig, "rewind:", "is ahead of the server's WAL position", "jetbox repair",
				last.Header.Get("Jetbox-Commit-Time"), last.Header.Get("Jetbox-Commit-LSN"))
			f.waitCount(6, time.Second)
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
