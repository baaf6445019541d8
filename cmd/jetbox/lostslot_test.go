package main

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jetbox-dev/jetbox/internal/testenv"
)

// These tests run jetbox run --on-lost-slot=repair against real servers:
// the instance that finds the slot lost repairs the stream from the table
// and streams on, with no operator.

const autoRepair = "JETBOX_ON_LOST_SLOT=repair"

// timelineOf is the timeline in a message's Jetbox-Source.
func timelineOf(m testenv.StreamMsg) string {
	parts := strings.Split(m.Header.Get("Jetbox-Source"), "/")
	if len(parts) < 2 {
		return ""
	}
	return parts[1]
}

// TestAutoRepairFailover: a primary with a streaming standby, writers
// committing throughout; the primary is crashed (immediate stop) and the
// standby promoted mid-load, without jetbox's slot (no failover slots).
// jetbox run --on-lost-slot=repair, given both hosts, repairs on the
// promoted server and streams on without exiting. Asserted: every row the
// promoted server holds is in the stream once; the streamed events in
// commit order and the repaired ones as jetbox repair orders them
// (assertRepaired); a message for a row the promoted server lacks (a
// phantom) is only ever one the old primary streamed (timeline 1, not
// repaired), and then jetbox stopped (exit 2) saying the timeline branched
// before the stream's last position, for an operator. Phantoms are possible:
// only --wait-for-standby-slots can keep the old primary from streaming
// what the standby has not received: with it on as well (the last case,
// --wait-for-standby-slots naming the standby's physical slot), there are
// none, and the stream holds exactly the promoted server's rows. The time
// from the promotion to the first message from the new primary is logged.
func TestAutoRepairFailover(t *testing.T) {
	if testing.Short() {
		t.Skip("real servers")
	}
	runsBeside(t)
	type autoCase struct {
		name    string
		env     string
		wait    bool     // no phantom allowed: jetbox, or the primary, waits for the standby
		standby []string // settings of the standby (17+ only)
	}
	var cases []autoCase
	for _, mode := range deliveryModes {
		cases = append(cases, autoCase{mode.name, mode.env, false, nil})
	}
	// After the promotion no standby streams from standby1 (the promoted
	// server's copy of the slot): publish after 2 s without the guarantee,
	// as --on-standby-slot-timeout=publish does, rather than wait for a
	// standby the test never rebuilds.
	cases = append(cases, autoCase{"exactly-once, waiting for the standby", "JETBOX_WAIT_FOR_STANDBY_SLOTS=standby1", true, nil})
	// PostgreSQL 17+: a promotion before the standby holds a persisted copy
	// of jetbox's failover slot (the window after every slot creation; here
	// the standby never synchronises it). The primary waits for the standby
	// (synchronized_standby_slots), so no phantom either.
	cases = append(cases, autoCase{"17+, a promotion inside the failover-slot window", "JETBOX_DELIVERY=exactly-once", true, []string{"sync_replication_slots=off"}})
	for _, mode := range cases {
		t.Run(mode.name, func(t *testing.T) {
			f, o, sb, major := haFixture(t, mode.standby...)
			if major >= 17 && mode.standby == nil {
				t.Skipf("PostgreSQL %d: the failover slot survives this promotion (TestFailoverWithFailoverSlots)", major)
			}
			env := []string{autoRepair, mode.env}
			if mode.wait {
				env = append(env, "JETBOX_STANDBY_SLOT_TIMEOUT=2s", "JETBOX_ON_STANDBY_SLOT_TIMEOUT=publish")
			}
			p := f.start(env...)
			f.waitStreaming(p)
			l := f.startLoad(3, 5*time.Millisecond, 1_000_000)
			defer l.stop()
			f.progress(300, time.Minute)
			if mode.wait {
				// The 2 s timeout holds before the promotion too: a standby
				// that fell 2 s behind (a loaded host) lets jetbox publish
				// without the guarantee until it catches up. Crash the
				// primary while the guarantee holds.
				testenv.WaitFor(t, time.Minute, func() error {
					log := p.logText()
					if strings.Count(log, "publishing WITHOUT the guarantee") > strings.Count(log, "caught up: publishing with the guarantee again") {
						return errors.New("jetbox publishes without the standby's guarantee until the standby catches up")
					}
					return nil
				})
			}
			promoted := failover(t, f, sb)

			// jetbox repairs and streams from the new primary, still running;
			// or, when the old primary streamed rows the standby never got
			// (possible only without waiting for it), stops for an operator.
			var streamedAfter uint64
			phantomStop := false
			testenv.WaitFor(t, 3*time.Minute, func() error {
				select {
				case <-p.done:
					if !mode.wait && p.code == exitConfig && strings.Contains(p.logText(), "may hold rows this server never got") {
						phantomStop = true
						return nil
					}
					t.Fatalf("jetbox exited with %d after the promotion:\n%s", p.code, p.tail(6144))
				default:
				}
				if !strings.Contains(p.logText(), "repair: done, streaming from the new slot") {
					return fmt.Errorf("no repair done yet")
				}
				n, err := testenv.StreamCount(f.js, "OUTBOX")
				if err != nil {
					return err
				}
				if streamedAfter == 0 {
					streamedAfter = n
				}
				if n < streamedAfter+100 {
					return fmt.Errorf("stream at %d, waiting for 100 streamed after the repair (%d)", n, streamedAfter)
				}
				return nil
			})
			l.stop()
			want := o.ids() // the promoted server's commits, in commit order
			table := f.rowKeys(keyCreatedAt)
			if phantomStop {
				// The stop must be right: the stream holds a row of the old
				// timeline that the promoted server lacks, and nothing was
				// repaired.
				phantoms := 0
				for _, m := range testenv.ReadStream(t, f.js, "OUTBOX", true) {
					if _, ok := table[m.ID]; !ok && timelineOf(m) == "1" {
						phantoms++
					}
					if m.Header.Get("Jetbox-Repaired") == "true" {
						t.Fatalf("seq %d repaired, yet jetbox stopped on the branched timeline", m.Seq)
					}
				}
				if phantoms == 0 {
					t.Fatalf("jetbox stopped on a branched timeline, yet the stream holds no row the promoted server lacks:\n%s", p.tail(6144))
				}
				t.Logf("%s: the old primary had streamed %d rows the standby never got: jetbox stopped for an operator (exit 2), as documented", mode.name, phantoms)
				return
			}
			if len(table) != len(want) {
				t.Fatalf("the promoted server's outbox holds %d rows, its oracle %d", len(table), len(want))
			}
			var msgs []testenv.StreamMsg
			testenv.WaitFor(t, 2*time.Minute, func() error {
				msgs = testenv.ReadStream(t, f.js, "OUTBOX", true)
				stored := map[string]bool{}
				for _, m := range msgs {
					stored[m.ID] = true
				}
				for id := range table {
					if !stored[id] {
						return fmt.Errorf("row %s of the promoted server not in the stream yet", id)
					}
				}
				return nil
			})
			var kept []testenv.StreamMsg
			phantoms, seen := 0, map[string]bool{}
			var first, firstStreamed *testenv.StreamMsg
			for i, m := range msgs {
				if seen[m.ID] {
					t.Fatalf("id %s stored twice (seq %d)", m.ID, m.Seq)
				}
				seen[m.ID] = true
				if timelineOf(m) != "1" {
					if first == nil {
						first = &msgs[i]
					}
					if firstStreamed == nil && m.Header.Get("Jetbox-Repaired") != "true" {
						firstStreamed = &msgs[i]
					}
				}
				if _, ok := table[m.ID]; !ok {
					if m.Header.Get("Jetbox-Repaired") == "true" || timelineOf(m) != "1" {
						t.Fatalf("seq %d (id %s, source %s) is not in the promoted table, yet came from the new primary", m.Seq, m.ID, m.Header.Get("Jetbox-Source"))
					}
					if mode.wait {
						t.Fatalf("seq %d (id %s, source %s): a phantom (its row is not on the promoted server), though jetbox waited for the standby", m.Seq, m.ID, m.Header.Get("Jetbox-Source"))
					}
					phantoms++
					continue
				}
				kept = append(kept, m)
			}
			repaired := f.assertRepairedMsgs(kept, want, keyCreatedAt)
			log := p.logText()
			if phantoms > 0 {
				t.Fatalf("%d phantoms, yet jetbox repaired instead of stopping on the timeline that branched before the stream's tip:\n%s", phantoms, p.tail(6144))
			}
			for _, w := range []string{`"cause":"promotion"`, "repair: started", "repair: done"} {
				if !strings.Contains(log, w) {
					t.Fatalf("log lacks %q:\n%s", w, p.tail(6144))
				}
			}
			at := func(m *testenv.StreamMsg) time.Duration {
				st, err := f.js.Stream(ctxT(t, 5*time.Second), "OUTBOX")
				must(t, err)
				raw, err := st.GetMsg(ctxT(t, 5*time.Second), m.Seq)
				must(t, err)
				return raw.Time.Sub(promoted).Round(time.Millisecond)
			}
			if first == nil || firstStreamed == nil {
				t.Fatal("no message from the new primary")
			}
			t.Logf("%s: %d rows on the promoted server, each once (%d repaired); %d phantoms (old primary's rows the standby never got); promotion to the first message from the new primary %s (repaired or baseline: %v), to the first streamed event %s",
				mode.name, len(want), repaired, phantoms, at(first), first.Header.Get("Jetbox-Repaired") == "true", at(firstStreamed))
			if code := p.stop(); code != exitOK {
				t.Fatalf("exit %d:\n%s", code, raceOrTail(p))
			}
		})
	}
}

// raceOrTail is the race detector's report in p's log, or its tail.
func raceOrTail(p *proc) string {
	log := p.logText()
	if i := strings.Index(log, "WARNING: DATA RACE"); i >= 0 {
		return log[i:min(len(log), i+8192)]
	}
	return p.tail(4096)
}

// lostSlotBacklog streams a few rows with jetbox run, stops it, drops the
// slot, and commits rows rows jetbox never streamed: a lost slot (cause
// dropped) with a backlog to repair. It returns the oracle.
func lostSlotBacklog(f *fixture, rows int) *oracle {
	f.t.Helper()
	o := f.newOracle()
	p := f.start()
	f.waitStreaming(p)
	f.insertTx(f.conn(), "before", 10)
	f.waitCount(10, time.Minute)
	if code := p.stop(); code != exitOK {
		f.t.Fatalf("exit %d:\n%s", code, p.tail(4096))
	}
	f.waitSlotReleased()
	f.pg.Exec(f.t, "SELECT pg_drop_replication_slot('jetbox')")
	f.backfill(rows)
	return o
}

// TestAutoRepairKilled: jetbox run --on-lost-slot=repair is killed
// (SIGKILL) in the middle of its repair, with writers committing; the
// next start finds the repair's marker and resumes it (its range, from
// Jetbox-Repair-Since), then streams: every row once, in order.
func TestAutoRepairKilled(t *testing.T) {
	if testing.Short() {
		t.Skip("real servers")
	}
	runsBeside(t)
	for _, mode := range deliveryModes {
		t.Run(mode.name, func(t *testing.T) {
			f := newFixture(t)
			// A small window: the resumed repair must skip the first one's
			// rows by their ids, not rely on dedup.
			f.env = append(f.env, "JETBOX_DUPLICATE_WINDOW=1s")
			o := lostSlotBacklog(f, 20_000)
			l := f.startLoad(2, 5*time.Millisecond, 1_000_000)
			defer l.stop()
			env := []string{autoRepair, mode.env}
			p := f.start(append(env, "JETBOX_MAX_IN_FLIGHT=1")...) // slow enough to kill half-way
			testenv.WaitFor(t, 3*time.Minute, func() error {
				select {
				case <-p.done:
					t.Fatalf("jetbox exited with %d before it was killed:\n%s", p.code, p.tail(4096))
				default:
				}
				n, err := testenv.StreamCount(f.js, "OUTBOX")
				if err == nil && n < 2_000 {
					err = fmt.Errorf("stream holds %d messages", n)
				}
				return err
			})
			p.kill()
			half, _ := testenv.StreamCount(f.js, "OUTBOX")
			if strings.Contains(p.logText(), "repair: done") {
				t.Fatalf("the repair finished (%d messages) before the kill", half)
			}
			if !strings.Contains(p.logText(), `"cause":"dropped"`) {
				t.Fatalf("the repair's cause is not dropped:\n%s", p.tail(4096))
			}
			var markers int
			must(t, f.conn().QueryRow(ctxT(t, 10*time.Second), "SELECT count(*) FROM pg_replication_slots WHERE slot_name = 'jetbox_repair_jetbox'").Scan(&markers))
			if markers != 1 {
				t.Fatal("no repair marker after the kill")
			}
			time.Sleep(1500 * time.Millisecond) // let the duplicate window pass: the hazard under test

			p = f.start(env...)
			testenv.WaitFor(t, 5*time.Minute, func() error {
				select {
				case <-p.done:
					t.Fatalf("jetbox exited with %d after the restart:\n%s", p.code, p.tail(4096))
				default:
				}
				if !strings.Contains(p.logText(), "repair: done") {
					return fmt.Errorf("the resumed repair is not done")
				}
				return nil
			})
			f.waitStreaming(p)
			if !strings.Contains(p.logText(), `"cause":"unfinished-repair"`) {
				t.Fatalf("the restart did not resume the unfinished repair:\n%s", p.tail(4096))
			}
			l.stop()
			want := o.ids()
			f.waitCount(len(want), 3*time.Minute)
			n := f.assertRepaired(want, keyCreatedAt)
			t.Logf("%s: killed with %d messages in the stream; %d rows, %d repaired (two attempts), each once", mode.name, half, len(want), n)
			if code := p.stop(); code != exitOK {
				t.Fatalf("exit %d:\n%s", code, p.tail(4096))
			}
		})
	}
}

// TestAutoRepairTwoInstances: two instances of jetbox run
// --on-lost-slot=repair start on the same lost slot at once: one takes the
// repair lock and repairs, the other stands by (and then stands by on the
// slot); every row once, in order.
func TestAutoRepairTwoInstances(t *testing.T) {
	if testing.Short() {
		t.Skip("real servers")
	}
	f := newFixture(t)
	o := lostSlotBacklog(f, 20_000)
	l := f.startLoad(2, 5*time.Millisecond, 1_000_000)
	defer l.stop()
	env := []string{autoRepair, "JETBOX_STANDBY_RETRY=500ms", "JETBOX_MAX_IN_FLIGHT=16"}
	a, b := f.start(env...), f.start(env...)
	repairs := func() (n int, waited bool) {
		for _, p := range []*proc{a, b} {
			log := p.logText()
			n += strings.Count(log, "repair: started")
			waited = waited || strings.Contains(log, "another instance repairs the slot: standing by")
		}
		return n, waited
	}
	testenv.WaitFor(t, 5*time.Minute, func() error {
		for _, p := range []*proc{a, b} {
			select {
			case <-p.done:
				t.Fatalf("an instance exited with %d:\n%s", p.code, p.tail(4096))
			default:
			}
		}
		if !strings.Contains(a.logText()+b.logText(), "repair: done") {
			return fmt.Errorf("no repair done yet")
		}
		return nil
	})
	f.waitStreaming(a)
	n, waited := repairs()
	if n != 1 || !waited {
		t.Fatalf("%d repairs started (want 1), the other instance waited: %v:\nA:\n%s\nB:\n%s", n, waited, a.tail(3000), b.tail(3000))
	}
	l.stop()
	want := o.ids()
	f.waitCount(len(want), 3*time.Minute)
	repaired := f.assertRepaired(want, keyCreatedAt)
	t.Logf("%d rows, %d repaired by one instance while the other stood by, each once", len(want), repaired)
	for _, p := range []*proc{a, b} {
		if code := p.stop(); code != exitOK {
			t.Fatalf("exit %d:\n%s", code, p.tail(4096))
		}
	}
}
