package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jetbox-dev/jetbox/internal/testenv"
)

// haFixture is a fixture whose Postgres has a streaming standby. jetbox,
// the writers and the test's own connections use a multi-host URL with
// target_session_attrs=read-write: whichever server is the primary.
//
// standby are extra settings of the standby.
//
// The oracle slot is made before the standby's copy, so the standby holds
// its own copy (a failover slot that never advances would stay temporary on
// the standby, not synchronised): after a promotion it decodes the promoted
// server's WAL from the start, the old timeline then the new one.
func haFixture(t *testing.T, standby ...string) (*fixture, *oracle, *testenv.Postgres, int) {
	f := newFixture(t)
	major := f.pg.Major(t)
	if len(standby) > 0 && major < 17 {
		t.Skipf("PostgreSQL %d: the standby settings %v need 17+: run with JETBOX_PG_BINDIR=$(.ci/fetch-postgres 17)", major, standby)
	}
	o := f.newOracle()
	sb := testenv.StartStandby(t, f.pg, standby...)
	url := fmt.Sprintf("postgres://postgres@127.0.0.1:%d,127.0.0.1:%d/postgres?sslmode=disable&target_session_attrs=read-write", f.pg.Port(), sb.Port())
	f.pg.DSN, f.pgURL = url, url
	f.env = append(f.env, "JETBOX_POSTGRES_TIMEOUT=10s", "JETBOX_STATUS_INTERVAL=500ms")
	return f, o, sb, major
}

// failover kills the primary (pg_ctl stop -m immediate: a crash) and
// promotes the standby; it returns, once the standby accepts writes, when
// the promotion was asked for.
func failover(t *testing.T, f *fixture, sb *testenv.Postgres) time.Time {
	f.pg.Stop("immediate")
	asked := time.Now()
	sb.Promote(t)
	return asked
}

// TestFailoverWithFailoverSlots (PostgreSQL 17+): a primary with a streaming
// standby that synchronises failover slots (jetbox creates its slot with
// failover enabled; the primary waits for the standby before decoding,
// synchronized_standby_slots). Writers commit while the primary is killed
// and the standby promoted; jetbox, given both hosts, follows to the new
// primary on its new timeline (restarted if it exits, as an orchestrator
// would, and once more killed and restarted on the new timeline). The stream then equals the promoted server's outbox, each row
// once, in commit order (the oracle slot was copied to the standby), in both
// delivery modes. The time from the promotion to the first event stored from
// the new primary is logged.
func TestFailoverWithFailoverSlots(t *testing.T) {
	for _, mode := range deliveryModes {
		t.Run(mode.name, func(t *testing.T) {
			f, o, sb, major := haFixture(t)
			if major < 17 {
				t.Skipf("PostgreSQL %d has no failover slots (17+): run with JETBOX_PG_BINDIR=$(.ci/fetch-postgres 17)", major)
			}
			p := f.start(mode.env)
			f.waitStreaming(p)
			l := f.startLoad(3, 5*time.Millisecond, 1_000_000)
			defer l.stop()
			f.progress(300, time.Minute)
			// jetbox's slot synchronised and persisted on the standby.
			sconn := sb.Conn(t)
			testenv.WaitFor(t, 2*time.Minute, func() error {
				var n int
				if err := sconn.QueryRow(ctxT(t, 5*time.Second), `SELECT count(*) FROM pg_replication_slots
					WHERE slot_name = 'jetbox' AND synced AND NOT temporary`).Scan(&n); err != nil {
					return err
				}
				if n != 1 {
					return errors.New("jetbox's slot not synchronised on the standby")
				}
				return nil
			})
			if got := strings.TrimSpace(queryString(t, f, "SELECT failover::text FROM pg_replication_slots WHERE slot_name = 'jetbox'")); got != "true" {
				t.Fatalf("jetbox's slot has failover = %s", got)
			}
			if mode.name == "dedup" {
				// jetbox check reports what the primary shows of it.
				var out, errOut bytes.Buffer
				if code := realMain([]string{"check", "--postgres-url=" + f.pgURL, "--nats-url=" + f.natURL}, &out, &errOut); code != exitOK {
					t.Fatalf("check: exit %d:\n%s%s", code, out.String(), errOut.String())
				}
				for _, want := range []string{`slot "jetbox" has failover = true`, "synchronized_standby_slots = standby1"} {
					if !strings.Contains(out.String(), want) {
						t.Fatalf("check output lacks %q:\n%s", want, out.String())
					}
				}
				if strings.Contains(out.String(), "hot_standby_feedback") {
					t.Fatalf("check warns about hot_standby_feedback of a standby that sends it:\n%s", out.String())
				}
				// A second jetbox pointed at the standby, on the same slot
				// name, finds the synchronised copy: refused, not a loop.
				on := f.start("JETBOX_POSTGRES_URL="+sb.DSN, "JETBOX_HTTP_ADDR=")
				on.waitExit(exitConfig, "a copy that sync_replication_slots keeps in step")
			}
			f.progress(600, time.Minute)
			promoted := failover(t, f, sb)

			// jetbox follows: an event from the new timeline is stored.
			var exits []int
			testenv.WaitFor(t, 2*time.Minute, func() error {
				select {
				case <-p.done:
					if p.code == exitConfig {
						t.Fatalf("jetbox refused the promoted server:\n%s", p.tail(4096))
					}
					exits = append(exits, p.code)
					p = f.start(mode.env)
				default:
				}
				ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
				defer cancel()
				st, err := f.js.Stream(ctx, "OUTBOX")
				if err != nil {
					return err
				}
				m, err := st.GetLastMsgForSubject(ctx, "outbox.>")
				if err != nil {
					return err
				}
				if src := m.Header.Get("Jetbox-Source"); strings.Split(src, "/")[1] == "1" {
					return fmt.Errorf("last event from %s", src)
				}
				return nil
			})
			// Restarted on the new timeline (its start-up checks the
			// history too), it goes on.
			p.kill()
			p = f.start(mode.env)
			f.waitStreaming(p)
			f.progress(0, time.Minute)
			want := f.finish(l, o)
			var rows int
			must(t, f.conn().QueryRow(ctxT(t, 10*time.Second), "SELECT count(*) FROM outbox").Scan(&rows))
			if rows != len(want) {
				t.Fatalf("the promoted server's outbox holds %d rows, its oracle %d", rows, len(want))
			}
			t.Logf("%s: promotion (pg_promote asked) to the first event stored from the new primary: %s; jetbox exits meanwhile (restarted): %d", mode.name, firstFromNewTimeline(t, f, promoted).Round(time.Millisecond), len(exits))
			if code := p.stop(); code != exitOK {
				t.Fatalf("exit %d:\n%s", code, p.tail(4096))
			}
		})
	}
}

// TestFailoverWithoutFailoverSlots (PostgreSQL before 17: no failover
// slots): the same failover leaves the promoted server without jetbox's
// slot, and the stream holds rows from the old primary: jetbox stops with
// the lost-slot error (exit 2, naming jetbox repair) instead of creating a
// new slot past the rows lost in between; jetbox repair then makes the
// stream whole from the table while the writers commit, and run goes on.
func TestFailoverWithoutFailoverSlots(t *testing.T) {
	for _, mode := range deliveryModes {
		t.Run(mode.name, func(t *testing.T) {
			f, _, sb, major := haFixture(t)
			if major >= 17 {
				t.Skipf("PostgreSQL %d has failover slots: TestFailoverWithFailoverSlots covers it", major)
			}
			p := f.start(mode.env)
			f.waitStreaming(p)
			l := f.startLoad(3, 5*time.Millisecond, 1_000_000)
			defer l.stop()
			f.progress(300, time.Minute)
			failover(t, f, sb)
			p.waitExit(exitConfig, "lost-slot:", `replication slot "jetbox" does not exist`, "jetbox repair")
			// A restart (an orchestrator's) refuses too, and creates no slot.
			p = f.start(mode.env)
			p.waitExit(exitConfig, "lost-slot:", "jetbox repair")
			var n int
			must(t, f.conn().QueryRow(ctxT(t, 10*time.Second), "SELECT count(*) FROM pg_replication_slots WHERE slot_name = 'jetbox'").Scan(&n))
			if n != 0 {
				t.Fatal("jetbox created a slot on the promoted server")
			}

			// The documented way on: jetbox repair (the writers still
			// commit), then jetbox run. The stream then holds every row the
			// promoted server's table holds, each once; rows the old primary
			// streamed that never reached the standby are the database's
			// loss (stored before the failover, absent from the table).
			rows := func() int {
				var n int
				must(t, f.conn().QueryRow(ctxT(t, 10*time.Second), "SELECT count(*) FROM outbox").Scan(&n))
				return n
			}
			before := rows()
			testenv.WaitFor(t, time.Minute, func() error { // the writers commit on the promoted server
				if n := rows(); n < before+50 {
					return fmt.Errorf("%d rows on the promoted server, waiting for %d", n, before+50)
				}
				return nil
			})
			f.repair()
			repaired, err := testenv.StreamCount(f.js, "OUTBOX")
			must(t, err)
			p = f.start(mode.env)
			f.waitStreaming(p)
			f.progress(repaired+100, time.Minute) // run streams the writers' rows
			l.stop()
			table := f.rowKeys(keyCreatedAt)
			testenv.WaitFor(t, time.Minute, func() error {
				stored := map[string]bool{}
				for _, m := range testenv.ReadStream(t, f.js, "OUTBOX", false) {
					stored[m.ID] = true
				}
				for id := range table {
					if !stored[id] {
						return fmt.Errorf("row %s of the promoted server is not in the stream", id)
					}
				}
				return nil
			})
			seen, extra := map[string]bool{}, 0
			for _, m := range testenv.ReadStream(t, f.js, "OUTBOX", true) {
				if seen[m.ID] {
					t.Fatalf("id %s stored twice (seq %d)", m.ID, m.Seq)
				}
				seen[m.ID] = true
				if _, ok := table[m.ID]; !ok {
					if m.Header.Get("Jetbox-Repaired") == "true" || strings.Split(m.Header.Get("Jetbox-Source"), "/")[1] != "1" {
						t.Fatalf("seq %d (id %s) is not in the promoted table, yet came from the new primary", m.Seq, m.ID)
					}
					extra++
				}
			}
			t.Logf("after repair: %d rows of the promoted server, each once; %d rows from the old primary the standby never received", len(table), extra)
			if code := p.stop(); code != exitOK {
				t.Fatalf("exit %d:\n%s", code, p.tail(4096))
			}
		})
	}
}

// firstFromNewTimeline returns when the stream stored its first message
// from a timeline after 1, relative to since.
func firstFromNewTimeline(t *testing.T, f *fixture, since time.Time) time.Duration {
	t.Helper()
	for _, m := range testenv.ReadStream(t, f.js, "OUTBOX", true) {
		if strings.Split(m.Header.Get("Jetbox-Source"), "/")[1] != "1" {
			st, err := f.js.Stream(ctxT(t, 5*time.Second), "OUTBOX")
			must(t, err)
			raw, err := st.GetMsg(ctxT(t, 5*time.Second), m.Seq)
			must(t, err)
			return raw.Time.Sub(since)
		}
	}
	t.Fatal("no message from the new timeline")
	return 0
}

func queryString(t *testing.T, f *fixture, sql string) string {
	t.Helper()
	var s string
	must(t, f.conn().QueryRow(ctxT(t, 10*time.Second), sql).Scan(&s))
	return s
}

// TestFailoverDuringRepair (PostgreSQL 17+): the primary fails while jetbox
// repair publishes a backfill, and the standby is promoted. The repair's
// marker is a physical slot, which no standby gets; its logical slot used
// to be a failover slot, synchronised to the standby: the promoted server
// then had the slot without the marker, jetbox run streamed from it and the
// rest of the snapshot was lost. The repair's slot becomes a failover slot
// only once the repair is done: after the promotion jetbox run finds no
// slot and refuses (lost slot), the repair run again on the promoted server
// finishes the backfill, and the stream holds every row once.
func TestFailoverDuringRepair(t *testing.T) {
	f, _, sb, major := haFixture(t)
	if major < 17 {
		t.Skipf("PostgreSQL %d has no failover slots (17+): run with JETBOX_PG_BINDIR=$(.ci/fetch-postgres 17)", major)
	}
	f.backfill(20_000)
	// The standby has every row before the repair starts.
	sconn := sb.Conn(t)
	testenv.WaitFor(t, time.Minute, func() error {
		var n int
		if err := sconn.QueryRow(ctxT(t, 5*time.Second), "SELECT count(*) FROM outbox").Scan(&n); err != nil {
			return err
		}
		if n != 20_000 {
			return fmt.Errorf("standby holds %d rows", n)
		}
		return nil
	})
	sconn.Close(ctxT(t, 5*time.Second))

	rp := f.startCmd([]string{"repair"}, "JETBOX_MAX_IN_FLIGHT=1") // slow enough to fail over half-way
	testenv.WaitFor(t, 2*time.Minute, func() error {
		select {
		case <-rp.done:
			t.Fatalf("repair exited with %d before the failover:\n%s", rp.code, rp.tail(4096))
		default:
		}
		n, err := testenv.StreamCount(f.js, "OUTBOX")
		if err == nil && n < 200 {
			err = fmt.Errorf("stream holds %d rows", n)
		}
		return err
	})
	if got := strings.TrimSpace(queryString(t, f, "SELECT failover::text FROM pg_replication_slots WHERE slot_name = 'jetbox'")); got != "false" {
		t.Fatalf("the slot of a running repair has failover = %s: a promotion would keep it without the repair's marker", got)
	}
	failover(t, f, sb)
	rp.kill()
	half, _ := testenv.StreamCount(f.js, "OUTBOX")
	if half >= 20_000 {
		t.Fatalf("the repair finished (%d messages) before the failover", half)
	}

	p := f.start()
	p.waitExit(exitConfig, "lost-slot:", "jetbox repair")
	rp = f.repair()
	if got := strings.TrimSpace(queryString(t, f, "SELECT failover::text FROM pg_replication_slots WHERE slot_name = 'jetbox'")); got != "true" {
		t.Fatalf("a finished repair's slot has failover = %s, want a failover slot as jetbox run makes", got)
	}
	var want []string
	rows, err := f.conn().Query(ctxT(t, time.Minute), "SELECT id::text FROM outbox ORDER BY created_at, id")
	must(t, err)
	for rows.Next() {
		var id string
		must(t, rows.Scan(&id))
		want = append(want, id)
	}
	must(t, rows.Err())
	f.assertRepaired(want, keyCreatedAt)
	t.Logf("failover with %d of %d rows repaired; the second repair published the rest", half, len(want))
}
