package replication

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jetbox-dev/jetbox/internal/metrics"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/rs/zerolog"
)

// fakeSlots is a slotReader whose positions the test moves: each read
// calls step (the clock and the standby moving on while the gate waits).
type fakeSlots struct {
	sent  pglogrepl.LSN
	slots []slotPos
	reads int
	step  func(f *fakeSlots)
	err   error
}

func (f *fakeSlots) read(context.Context) (slotReading, error) {
	f.reads++
	if f.step != nil {
		f.step(f)
	}
	return slotReading{sent: f.sent, slots: append([]slotPos(nil), f.slots...)}, f.err
}
func (f *fakeSlots) close() {}

// fakeGate is a gate on r with a fake clock that each sleep advances.
func fakeGate(t *testing.T, r slotReader, onTimeout string) (*standbyGate, *time.Time) {
	t.Helper()
	now := time.Unix(1000, 0)
	var state atomic.Pointer[StandbySlotState]
	g := &standbyGate{cfg: StandbySlotsConfig{Slots: []string{"s1"}, Timeout: time.Second, OnTimeout: onTimeout}, r: r,
		log: zerolog.New(zerolog.NewTestWriter(t)), metrics: metrics.New(), state: &state,
		now: func() time.Time { return now },
		sleep: func(ctx context.Context, d time.Duration) error {
			now = now.Add(d)
			return ctx.Err()
		}}
	return g, &now
}

func physical(flush pglogrepl.LSN) slotPos {
	return slotPos{name: "s1", exists: true, phys: true, active: true, flush: flush}
}

func noKeep() error { return nil }

// TestStandbyGateWaitsForFlushPastSent: a transaction passes only once the
// slot flushed the walsender's position read after it arrived (which lies
// past its commit record's end), not merely past where the record starts;
// later transactions that start before that position pass without a read.
func TestStandbyGateWaitsForFlushPastSent(t *testing.T) {
	f := &fakeSlots{sent: 0x2000, slots: []slotPos{physical(0x1000)}}
	f.step = func(f *fakeSlots) {
		if f.reads == 3 {
			f.slots[0].flush = 0x1800 // past the commit's start, short of the record's end
		}
		if f.reads == 5 {
			f.slots[0].flush = 0x2000
		}
	}
	g, _ := fakeGate(t, f, StandbySlotWait)
	if err := g.pass(context.Background(), 0x1500, noKeep); err != nil {
		t.Fatal(err)
	}
	if f.reads != 5 {
		t.Fatalf("passed after %d reads, want 5 (at the read whose flush reached sent_lsn 0/2000)", f.reads)
	}
	// 0/1F00 starts before the position read: its record ends by then.
	if err := g.pass(context.Background(), 0x1F00, noKeep); err != nil || f.reads != 5 {
		t.Fatalf("a commit before the flushed sent_lsn read again (%d reads) or failed: %v", f.reads, err)
	}
	// 0/2000 starts at it: it may end past it, so the gate reads again.
	f.sent = 0x3000
	f.step = func(f *fakeSlots) { f.slots[0].flush = 0x3000 }
	if err := g.pass(context.Background(), 0x2000, noKeep); err != nil || f.reads != 6 {
		t.Fatalf("commit at the flushed sent_lsn: %d reads (want 6), err %v", f.reads, err)
	}
}

// TestStandbyGateSlowestSlot: every named slot must have flushed.
func TestStandbyGateSlowestSlot(t *testing.T) {
	s2 := physical(0x1000)
	s2.name = "s2"
	f := &fakeSlots{sent: 0x2000, slots: []slotPos{physical(0x5000), s2}}
	f.step = func(f *fakeSlots) {
		if f.reads == 4 {
			f.slots[1].flush = 0x2000
		}
	}
	g, _ := fakeGate(t, f, StandbySlotWait)
	if err := g.pass(context.Background(), 0x1500, noKeep); err != nil {
		t.Fatal(err)
	}
	if f.reads != 4 {
		t.Fatalf("passed after %d reads, want 4 (when the slower slot s2 flushed)", f.reads)
	}
}

// TestStandbyGateTimeoutWait: past the timeout the gate warns (state and
// metric) and keeps waiting, sending status through keep; the standby's
// return lets the transaction through and clears the warning.
func TestStandbyGateTimeoutWait(t *testing.T) {
	f := &fakeSlots{sent: 0x2000, slots: []slotPos{physical(0x1000)}}
	var g *standbyGate
	var now *time.Time
	var start time.Time
	sawWaiting := false
	f.step = func(f *fakeSlots) {
		if now.Sub(start) > 3*time.Second {
			f.slots[0].flush = 0x2000
		}
	}
	g, now = fakeGate(t, f, StandbySlotWait)
	start = *now
	keeps := 0
	keep := func() error {
		keeps++
		if g.state.Load() != nil && g.state.Load().Waiting {
			sawWaiting = true
			if testutil.ToFloat64(g.metrics.StandbySlotWaiting) != 1 {
				t.Error("jetbox_standby_slot_waiting is not 1 while waiting past the timeout")
			}
			if len(g.state.Load().Behind) != 1 {
				t.Errorf("Behind = %q, want the one slot", g.state.Load().Behind)
			}
		}
		return nil
	}
	if err := g.pass(context.Background(), 0x1500, keep); err != nil {
		t.Fatal(err)
	}
	if !sawWaiting {
		t.Fatal("the gate never reported waiting past the timeout")
	}
	if now.Sub(start) < 3*time.Second {
		t.Fatalf("passed after %s, before the standby flushed", now.Sub(start))
	}
	if st := g.state.Load(); st.Waiting || testutil.ToFloat64(g.metrics.StandbySlotWaiting) != 0 {
		t.Fatalf("still waiting after the standby caught up: %+v", st)
	}
	if keeps == 0 {
		t.Fatal("keep never ran while waiting")
	}
}

// TestStandbyGateTimeoutPublish: with OnTimeout publish, the transaction
// goes on at the timeout, later ones pass unguarded (reading at most once
// a second), and the gate guards again once the slot caught up.
func TestStandbyGateTimeoutPublish(t *testing.T) {
	f := &fakeSlots{sent: 0x2000, slots: []slotPos{physical(0x1000)}}
	g, now := fakeGate(t, f, StandbySlotPublish)
	start := *now
	if err := g.pass(context.Background(), 0x1500, noKeep); err != nil {
		t.Fatal(err)
	}
	if waited := now.Sub(start); waited < time.Second || waited > 1100*time.Millisecond {
		t.Fatalf("went on after %s, want the 1s timeout", waited)
	}
	if !g.unguarded || testutil.ToFloat64(g.metrics.StandbySlotUnguarded) != 1 {
		t.Fatal("not unguarded after the timeout")
	}
	reads := f.reads
	f.sent = 0x3000
	if err := g.pass(context.Background(), 0x2500, noKeep); err != nil || f.reads != reads {
		t.Fatalf("unguarded pass read the slots within a second (%d reads, was %d): %v", f.reads, reads, err)
	}
	*now = now.Add(2 * time.Second)
	if err := g.pass(context.Background(), 0x2600, noKeep); err != nil || f.reads != reads+1 || !g.unguarded {
		t.Fatalf("unguarded recheck: %d reads (want %d), unguarded %v, err %v", f.reads, reads+1, g.unguarded, err)
	}
	f.slots[0].flush = 0x3000
	*now = now.Add(2 * time.Second)
	if err := g.pass(context.Background(), 0x2700, noKeep); err != nil || g.unguarded {
		t.Fatalf("still unguarded after the slot caught up (err %v)", err)
	}
	if testutil.ToFloat64(g.metrics.StandbySlotUnguarded) != 0 {
		t.Fatal("jetbox_standby_slot_unguarded stays 1")
	}
}

// TestStandbyGateMissingSlot: a slot dropped while jetbox runs holds
// everything back, and says so.
func TestStandbyGateMissingSlot(t *testing.T) {
	f := &fakeSlots{sent: 0x2000, slots: []slotPos{{name: "s1"}}}
	g, _ := fakeGate(t, f, StandbySlotWait)
	ctx, cancel := context.WithCancel(context.Background())
	keep := func() error {
		if f.reads > 200 {
			cancel()
		}
		return nil
	}
	err := g.pass(ctx, 0x1500, keep)
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("pass = %v, want the cancel (it must wait for a missing slot)", err)
	}
	if st := g.state.Load(); st == nil || len(st.Behind) != 1 || st.Behind[0] != `slot "s1" does not exist` {
		t.Fatalf("state %+v does not name the missing slot", st)
	}
}

// TestStandbyGateKeepError: keep's error (a failed status send, a stop
// from the monitor) ends the wait.
func TestStandbyGateKeepError(t *testing.T) {
	f := &fakeSlots{sent: 0x2000, slots: []slotPos{physical(0x1000)}}
	g, _ := fakeGate(t, f, StandbySlotWait)
	stop := errors.New("stop")
	if err := g.pass(context.Background(), 0x1500, func() error { return stop }); !errors.Is(err, stop) {
		t.Fatalf("pass = %v, want keep's error", err)
	}
}

func TestParseStandbySlots(t *testing.T) {
	got, err := ParseStandbySlots(" a, b_2 ,,")
	if err != nil || len(got) != 2 || got[0] != "a" || got[1] != "b_2" {
		t.Fatalf("ParseStandbySlots = %q, %v", got, err)
	}
	if _, err := ParseStandbySlots("a,A-1,a"); err == nil {
		t.Fatal("an invalid and a repeated name were accepted")
	}
}
