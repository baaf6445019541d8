package replication

// Unit tests of the receive loop against a fake walsender and a scripted
// fake sink (fake_test.go): republish order, status updates under
// backpressure, the flush position, keepalives, standby and shutdown bounds.
// They need no server and run in milliseconds, -short included.

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jetbox-dev/jetbox/decoder"
	"github.com/jetbox-dev/jetbox/internal/metrics"
	"github.com/rs/zerolog"
	"go.uber.org/goleak"
)

// waitFor polls cond until it holds, failing the test after a generous
// deadline (the machine may be loaded: the deadline is a hang detector).
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(time.Millisecond)
	}
}

// testLog writes the streamer's log to the test log until the test ends.
type testLog struct {
	mu   sync.Mutex
	t    *testing.T
	done bool
}

func (w *testLog) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if !w.done {
		w.t.Log(strings.TrimRight(string(p), "\n"))
	}
	return len(p), nil
}

// scripted is one outbox row the fake walsender streams.
type scripted struct {
	commit pglogrepl.LSN
	index  int
	rows   int // rows of its transaction
}

// txn is a scripted transaction of outbox inserts.
type txn struct {
	commit, end pglogrepl.LSN
	xid         uint32
	ids         []string
}

func (x txn) begin() []byte          { return xlogData(x.commit-0x80, beginMsg(x.commit, x.xid)) }
func (x txn) insert(i int) []byte    { return xlogData(x.commit-0x40, insertMsg(x.ids[i])) }
func (x txn) commitData() []byte     { return xlogData(x.commit, commitMsg(x.commit, x.end)) }
func (x txn) rest(from int) []string { return x.ids[from:] }
func (x txn) all() [][]byte {
	out := [][]byte{x.begin()}
	for i := range x.ids {
		out = append(out, x.insert(i))
	}
	return append(out, x.commitData())
}

type harness struct {
	t     *testing.T
	wal   *fakeWAL
	sink  *fakeSink
	s     *Streamer
	start pglogrepl.LSN

	mu     sync.Mutex
	events map[string]scripted
	next   pglogrepl.LSN
	xid    uint32

	cancel context.CancelFunc
	done   chan error
}

const startLSN = pglogrepl.LSN(0x1000000)

// newHarness returns a streamer wired to a fake walsender (through the
// connection config's DialFunc) and to sink, with the slot monitor off.
// Zero fields of cfg get test values. At the end of the test it stops the
// streamer, checks the invariants the fake walsender recorded and that no
// goroutine is left behind.
func newHarness(t *testing.T, cfg Config, sink *fakeSink) *harness {
	t.Helper()
	t.Cleanup(func() { goleak.VerifyNone(t) }) // runs last
	h := &harness{t: t, wal: newFakeWAL(t, startLSN), sink: sink, start: startLSN,
		events: map[string]scripted{}, next: startLSN + 0x1000}
	cfg.Slot, cfg.Publication = "jetbox", "jetbox_pub"
	cfg.Decoder = decoder.Config{Schema: "public", Table: "outbox", Columns: decoder.DefaultColumns, SubjectPrefix: "outbox"}
	if cfg.StatusInterval == 0 {
		cfg.StatusInterval = 10 * time.Millisecond
	}
	if cfg.MaxInFlight == 0 {
		cfg.MaxInFlight = 100
	}
	if cfg.MaxBackoff == 0 {
		cfg.MaxBackoff = 20 * time.Millisecond
	}
	if cfg.StandbyRetry == 0 {
		cfg.StandbyRetry = 20 * time.Millisecond
	}
	if cfg.ShutdownTimeout == 0 {
		cfg.ShutdownTimeout = 5 * time.Second
	}
	cfg.MonitorInterval = -1 // off: it would open SQL connections of its own
	cfg.Metrics = metrics.New()
	lw := &testLog{t: t}
	s, err := New("postgres://jetbox@127.0.0.1:5432/app?sslmode=disable", cfg, sink, zerolog.New(lw).Level(zerolog.InfoLevel))
	if err != nil {
		t.Fatal(err)
	}
	s.connCfg.DialFunc = h.wal.dial
	s.connCfg.TLSConfig, s.connCfg.Fallbacks = nil, nil
	h.s = s
	h.wal.check = h.checkStatus
	t.Cleanup(func() {
		if h.done != nil {
			h.cancel()
			select {
			case <-h.done:
			case <-time.After(30 * time.Second):
				t.Error("Run did not return 30s after the stop")
			}
		}
		waited := make(chan struct{})
		go func() { h.wal.wg.Wait(); close(waited) }()
		select {
		case <-waited:
		case <-time.After(10 * time.Second):
			t.Error("fake walsender connections still open 10s after Run returned")
		}
		h.wal.mu.Lock()
		for _, e := range h.wal.errs {
			t.Error(e)
		}
		h.wal.mu.Unlock()
		lw.mu.Lock()
		lw.done = true
		lw.mu.Unlock()
	})
	return h
}

// checkStatus is the invariant of every status update: the three
// positions are equal, and the flush position confirms no transaction
// holding an event the sink has not stored (Postgres skips a transaction
// whose commit record starts below the confirmed position).
func (h *harness) checkStatus(st status) error {
	if st.write != st.flush || st.apply != st.flush {
		return fmt.Errorf("positions differ: write %s flush %s apply %s", st.write, st.flush, st.apply)
	}
	h.mu.Lock()
	events := make(map[string]scripted, len(h.events))
	for id, e := range h.events {
		events[id] = e
	}
	h.mu.Unlock()
	for id, e := range events {
		if st.flush > e.commit && h.sink.storedCount(id) == 0 {
			return fmt.Errorf("flush %s confirms the transaction (commit %s) of %s, which the sink has not stored", st.flush, e.commit, id)
		}
	}
	return nil
}

// tx scripts a transaction of n outbox rows after everything scripted so far.
func (h *harness) tx(n int) txn {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.xid++
	x := txn{xid: h.xid, commit: h.next + pglogrepl.LSN(0x100*(n+1))}
	x.end = x.commit + 0x30
	h.next = x.end + 0x100
	for i := 0; i < n; i++ {
		id := fmt.Sprintf("x%d-%d", x.xid, i)
		x.ids = append(x.ids, id)
		h.events[id] = scripted{commit: x.commit, index: i, rows: n}
	}
	return x
}

// lsn returns a WAL position after everything scripted so far.
func (h *harness) lsn() pglogrepl.LSN {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.next += 0x1000
	return h.next
}

func (h *harness) run() {
	ctx, cancel := context.WithCancel(context.Background())
	h.cancel, h.done = cancel, make(chan error, 1)
	go func() { h.done <- h.s.Run(ctx) }()
}

// stop cancels Run and waits for it to return, failing after bound.
func (h *harness) stop(bound time.Duration) (time.Duration, error) {
	h.t.Helper()
	began := time.Now()
	h.cancel()
	select {
	case err := <-h.done:
		h.done = nil
		return time.Since(began), err
	case <-time.After(bound):
		h.t.Fatalf("Run did not return within %s of the stop", bound)
		return 0, nil
	}
}

// finished stops the streamer and waits for the fake walsender to see
// the connection end, so every status update sent is recorded.
func (h *harness) finished() {
	h.t.Helper()
	if _, err := h.stop(30 * time.Second); err != nil {
		h.t.Fatalf("Run returned %v after a stop, want nil", err)
	}
	waitFor(h.t, "the walsender connections to end", func() bool {
		done := make(chan struct{})
		go func() { h.wal.wg.Wait(); close(done) }()
		select {
		case <-done:
			return true
		case <-time.After(time.Second):
			return false
		}
	})
}

func (h *harness) waitStored(ids ...string) {
	h.t.Helper()
	waitFor(h.t, fmt.Sprintf("the sink to store %v", ids), func() bool {
		for _, id := range ids {
			if h.sink.storedCount(id) == 0 {
				return false
			}
		}
		return true
	})
}

func (h *harness) waitFlush(lsn pglogrepl.LSN) {
	h.t.Helper()
	waitFor(h.t, "a status update with flush "+lsn.String(), func() bool { return h.wal.lastFlush() == lsn })
}

// assertStoredOnceInOrder checks the sink stored exactly ids, each once, in
// this order.
func (h *harness) assertStoredOnceInOrder(ids ...string) {
	h.t.Helper()
	_, stored, _ := h.sink.snapshot()
	var got []string
	for _, it := range stored {
		got = append(got, it.id)
	}
	if !slices.Equal(got, ids) {
		h.t.Fatalf("sink stored %v, want each of %v once, in order", got, ids)
	}
}

func byID(ids ...string) func(*item) bool {
	return func(it *item) bool { return slices.Contains(ids, it.id) }
}

func concat(parts ...[]string) []string { return slices.Concat(parts...) }

var errNoAck = errors.New("fake: no PubAck")

// A failure in the middle of the window republishes from the first unacked
// event, in window order: the events acked meanwhile are not sent again,
// none is skipped, and the replication connection stays up.
func TestRepublishFromFirstUnackedInOrder(t *testing.T) {
	sink := &fakeSink{}
	h := newHarness(t, Config{}, sink)
	a, b := h.tx(4), h.tx(4)
	sink.setDecide(func(sess int, ev *decoder.Event) verdict {
		if sess > 1 || ev.ID == a.ids[0] {
			return ack
		}
		return hold
	})
	h.run()
	h.wal.send(append(a.all(), b.all()...)...)
	waitFor(t, "8 publishes", func() bool { return len(sink.publishedIn(1)) == 8 })
	// Acks out of order, then a2 fails; b1..b3 never get theirs (the
	// session's Close gives up on them).
	if n := sink.release(byID(a.ids[1], a.ids[3], b.ids[0]), nil); n != 3 {
		t.Fatalf("released %d", n)
	}
	if n := sink.release(byID(a.ids[2]), errNoAck); n != 1 {
		t.Fatalf("failed %d", n)
	}
	h.waitStored(concat(a.ids, b.ids)...)
	if got, want := sink.publishedIn(2), concat(a.rest(2)[:1], b.rest(1)); !slices.Equal(got, want) {
		t.Fatalf("republished %v, want %v", got, want)
	}
	h.waitFlush(b.end)
	h.assertStoredOnceInOrder(a.ids[0], a.ids[1], a.ids[3], b.ids[0], a.ids[2], b.ids[1], b.ids[2], b.ids[3])
	if _, sessions, _ := sink.stats(); sessions != 2 {
		t.Fatalf("%d sink sessions, want 2", sessions)
	}
	if conns, _, _ := h.wal.counts(); conns != 1 {
		t.Fatalf("%d replication connections, want 1: republishing must not reconnect", conns)
	}
	h.finished()
}

// A synchronous refusal while republishing stops that attempt at the
// refused event (nothing after it is sent out of order); the next attempt
// starts from it.
func TestRepublishAfterSynchronousRefusal(t *testing.T) {
	sink := &fakeSink{}
	h := newHarness(t, Config{}, sink)
	x := h.tx(4)
	sink.setDecide(func(sess int, ev *decoder.Event) verdict {
		switch {
		case sess == 1 && ev.ID != x.ids[0]:
			return hold
		case sess == 2 && ev.ID == x.ids[2]:
			return refuse
		}
		return ack
	})
	h.run()
	h.wal.send(x.all()...)
	waitFor(t, "4 publishes", func() bool { return len(sink.publishedIn(1)) == 4 })
	sink.release(byID(x.ids[1]), errNoAck)
	h.waitStored(x.ids...)
	h.waitFlush(x.end)
	if got, want := sink.publishedIn(2), x.ids[1:3]; !slices.Equal(got, want) {
		t.Fatalf("session 2 got %v, want %v (nothing after the refused event)", got, want)
	}
	if got, want := sink.publishedIn(3), x.ids[2:]; !slices.Equal(got, want) {
		t.Fatalf("session 3 got %v, want %v", got, want)
	}
	h.assertStoredOnceInOrder(x.ids...)
	h.finished()
}

// While the loop waits for room in a full window it does not read from
// the walsender, but status updates keep going out, confirming nothing new.
func TestStatusUpdatesFlowWhileWindowFull(t *testing.T) {
	sink := &fakeSink{}
	h := newHarness(t, Config{MaxInFlight: 2}, sink)
	x := h.tx(3)
	sink.setDecide(func(int, *decoder.Event) verdict { return hold })
	h.run()
	h.wal.send(x.all()...)
	waitFor(t, "a full window", func() bool { return len(sink.publishedIn(1)) == 2 })
	_, _, before := h.wal.counts()
	waitFor(t, "5 status updates while the window is full", func() bool {
		_, _, n := h.wal.counts()
		return n >= before+5
	})
	if n := len(sink.publishedIn(1)); n != 2 {
		t.Fatalf("%d publishes with a full window of 2", n)
	}
	for _, st := range h.wal.allStatuses() {
		if st.flush != h.start {
			t.Fatalf("status %+v while nothing is acked: want flush %s", st, h.start)
		}
	}
	sink.setDecide(func(int, *decoder.Event) verdict { return ack })
	sink.release(func(*item) bool { return true }, nil)
	h.waitStored(x.ids...)
	h.waitFlush(x.end)
	h.assertStoredOnceInOrder(x.ids...)
	h.finished()
}

// While the sink cannot open a session (NATS down) the loop retries with
// backoff and keeps status updates flowing on the same connection, during
// each backoff wait too (several status intervals long).
func TestStatusUpdatesFlowWhileSinkDown(t *testing.T) {
	sink := &fakeSink{}
	h := newHarness(t, Config{StatusInterval: 5 * time.Millisecond, MaxBackoff: 150 * time.Millisecond}, sink)
	var mu sync.Mutex
	var marks []int // status updates received at each Open
	sink.onOpen = func() {
		_, _, n := h.wal.counts()
		mu.Lock()
		marks = append(marks, n)
		mu.Unlock()
	}
	x := h.tx(2)
	sink.setDecide(func(sess int, ev *decoder.Event) verdict {
		if sess == 1 && ev.ID == x.ids[0] {
			sink.down.Store(true)
			return fail
		}
		return ack
	})
	h.run()
	h.wal.send(x.all()...)
	waitFor(t, "3 failed opens", func() bool { opens, _, _ := sink.stats(); return opens >= 4 })
	if st := h.wal.lastFlush(); st != h.start {
		t.Fatalf("flush %s while the sink is down, want %s", st, h.start)
	}
	sink.down.Store(false)
	h.waitStored(x.ids...)
	h.waitFlush(x.end)
	h.assertStoredOnceInOrder(x.ids...)
	mu.Lock()
	t.Logf("status updates received at each Open: %v", marks)
	for i := 2; i < 4; i++ { // between failed opens: one backoff wait (≥ 75ms) each
		if n := marks[i] - marks[i-1]; n < 4 {
			t.Errorf("%d status updates between open attempts %d and %d (backoff ≥ 15 status intervals), want ≥ 4; all: %v", n, i, i+1, marks)
		}
	}
	mu.Unlock()
	if conns, _, _ := h.wal.counts(); conns != 1 {
		t.Fatalf("%d replication connections, want 1", conns)
	}
	h.finished()
}

// The flush position stops at the end of the last transaction acked with
// everything before it: an unacked event holds it back even when later
// transactions are acked, when a keepalive reports a later position, and
// in the final status update of a stop.
func TestFlushNeverPassesUnackedEvent(t *testing.T) {
	sink := &fakeSink{}
	h := newHarness(t, Config{}, sink)
	a, b, c := h.tx(2), h.tx(3), h.tx(1)
	sink.setDecide(func(_ int, ev *decoder.Event) verdict {
		if ev.ID == b.ids[1] {
			return hold
		}
		return ack
	})
	h.run()
	h.wal.send(slices.Concat(a.all(), b.all(), c.all())...)
	h.waitStored(a.ids[0], a.ids[1], b.ids[0], b.ids[2], c.ids[0])
	h.waitFlush(a.end)
	h.wal.send(keepalive(h.lsn(), true))
	_, _, before := h.wal.counts()
	waitFor(t, "more status updates", func() bool { _, _, n := h.wal.counts(); return n >= before+3 })
	if got := h.wal.lastFlush(); got != a.end {
		t.Fatalf("flush %s with %s unacked, want %s", got, b.ids[1], a.end)
	}
	_, _, before = h.wal.counts()
	h.finished() // Close gives up on b1: it is failed, not confirmed
	all := h.wal.allStatuses()
	if len(all) <= before {
		t.Fatal("no status update at shutdown")
	}
	if got := all[len(all)-1].flush; got != a.end {
		t.Fatalf("final flush %s, want %s", got, a.end)
	}
	if got := h.wal.slotLSN(); got != a.end {
		t.Fatalf("slot confirmed %s, want %s", got, a.end)
	}
}

// A keepalive's ServerWALEnd becomes the flush position only when the
// window is empty and no transaction is open. With a status interval of an
// hour, the only status updates are the first one and those the
// keepalives ask for.
func TestKeepaliveAdoptedOnlyWhenIdle(t *testing.T) {
	sink := &fakeSink{}
	h := newHarness(t, Config{StatusInterval: time.Hour}, sink)
	reply := func(want int, walEnd pglogrepl.LSN) pglogrepl.LSN {
		t.Helper()
		h.wal.send(keepalive(walEnd, true))
		waitFor(t, fmt.Sprintf("status update %d", want), func() bool { _, _, n := h.wal.counts(); return n >= want })
		if _, _, n := h.wal.counts(); n != want {
			t.Fatalf("%d status updates, want %d", n, want)
		}
		return h.wal.lastFlush()
	}
	h.run()
	waitFor(t, "the first status update", func() bool { _, _, n := h.wal.counts(); return n == 1 })

	k1 := h.lsn()
	if got := reply(2, k1); got != k1 {
		t.Fatalf("idle: flush %s, want the keepalive's %s", got, k1)
	}

	x := h.tx(2)
	sink.setDecide(func(_ int, ev *decoder.Event) verdict {
		if ev.ID == x.ids[1] {
			return hold
		}
		return ack
	})
	h.wal.send(x.begin(), x.insert(0))
	h.waitStored(x.ids[0]) // the window is empty, the transaction open
	if got := reply(3, h.lsn()); got != k1 {
		t.Fatalf("open transaction: flush %s, want %s", got, k1)
	}

	h.wal.send(x.insert(1), x.commitData())
	waitFor(t, "the second publish", func() bool { return len(sink.publishedIn(1)) == 2 })
	if got := reply(4, h.lsn()); got != k1 { // committed, x1 unacked
		t.Fatalf("unacked event: flush %s, want %s", got, k1)
	}

	sink.release(byID(x.ids[1]), nil)
	h.waitStored(x.ids[1])
	k4 := h.lsn()
	if got := reply(5, k4); got != k4 {
		t.Fatalf("idle again: flush %s, want the keepalive's %s", got, k4)
	}
	h.finished()
}

// START_REPLICATION failing with 55006 (another instance holds the slot)
// puts the streamer in standby, retrying; it takes over once the slot is
// free.
//
// A standby opens no publishing session: opening one reads the stream the
// active instance writes as this process's own (exactly-once raised its
// last acked sequence to the tip, and more than a window stored before the
// next retry read as a foreign writer: exit 1). The sink is opened only
// once START_REPLICATION got the slot.
func TestStandbyTakesOverWhenSlotFreed(t *testing.T) {
	sink := &fakeSink{}
	h := newHarness(t, Config{}, sink)
	var mu sync.Mutex
	var marks []int // START_REPLICATIONs that got the slot, at each Open
	sink.onOpen = func() {
		n := h.wal.streamed()
		mu.Lock()
		marks = append(marks, n)
		mu.Unlock()
	}
	h.wal.setSlotBusy(true)
	h.run()
	waitFor(t, "standby and 3 attempts", func() bool {
		_, starts, _ := h.wal.counts()
		return h.s.State() == StateStandby && starts >= 3
	})
	if h.s.Ready() {
		t.Fatal("ready in standby")
	}
	if _, _, n := h.wal.counts(); n != 0 {
		t.Fatalf("%d status updates sent by a standby", n)
	}
	if opens, _, _ := sink.stats(); opens != 0 {
		t.Fatalf("%d publishing sessions opened by a standby, want none", opens)
	}
	h.wal.setSlotBusy(false)
	waitFor(t, "streaming", func() bool { return h.s.State() == StateStreaming })
	mu.Lock()
	if !slices.Equal(marks, []int{1}) {
		t.Fatalf("slots got at each Open: %v; want one Open, after the slot was got", marks)
	}
	mu.Unlock()
	if closed := sink.closed(); !slices.Equal(closed, []bool{false}) {
		t.Fatalf("sink sessions closed: %v; want only the streaming one, open", closed)
	}
	x := h.tx(2)
	h.wal.send(x.all()...)
	h.waitStored(x.ids...)
	h.waitFlush(x.end)
	h.assertStoredOnceInOrder(x.ids...)
	waitFor(t, "ConfirmedLSN "+x.end.String(), func() bool { return h.s.ConfirmedLSN() == x.end })
	h.finished()
	if st := h.s.State(); st != StateStopped {
		t.Fatalf("state %s after Run, want stopped", st)
	}
}

// A stop while the sink's Close hangs (acks that never come) returns
// within --shutdown-timeout plus a margin, confirming nothing unacked.
func TestStopWithHangingCloseIsBounded(t *testing.T) {
	const shutdown = 300 * time.Millisecond
	sink := &fakeSink{hangClose: true}
	h := newHarness(t, Config{ShutdownTimeout: shutdown}, sink)
	x := h.tx(2)
	sink.setDecide(func(int, *decoder.Event) verdict { return hold })
	h.run()
	h.wal.send(x.all()...)
	waitFor(t, "2 publishes", func() bool { return len(sink.publishedIn(1)) == 2 })
	took, err := h.stop(shutdown + 3*time.Second)
	if err != nil {
		t.Fatalf("Run: %v", err)
	}
	t.Logf("stopped in %s (shutdown timeout %s)", took, shutdown)
	if _, _, gaveUp := sink.stats(); gaveUp != 1 {
		t.Fatalf("Close gave up %d times, want 1", gaveUp)
	}
	if got := h.wal.lastFlush(); got != h.start {
		t.Fatalf("flush %s, want %s", got, h.start)
	}
}

// Review case 9, loop side: a stop while republishing waits on a slow sink
// Close (whose own cap is minutes) is bounded by --shutdown-timeout.
func TestStopDuringRepublishSlowCloseIsBounded(t *testing.T) {
	const shutdown = 300 * time.Millisecond
	sink := &fakeSink{hangClose: true}
	h := newHarness(t, Config{ShutdownTimeout: shutdown}, sink)
	x := h.tx(2)
	sink.setDecide(func(_ int, ev *decoder.Event) verdict {
		if ev.ID == x.ids[0] {
			return hold
		}
		return fail
	})
	h.run()
	h.wal.send(x.all()...)
	waitFor(t, "republishing, waiting in Close", func() bool {
		return sink.closes() >= 1 && h.s.State() == StateRepublishing
	})
	took, err := h.stop(shutdown + 3*time.Second)
	if err != nil {
		t.Fatalf("Run: %v", err)
	}
	t.Logf("stopped in %s (shutdown timeout %s)", took, shutdown)
	if got := h.wal.lastFlush(); got != h.start {
		t.Fatalf("flush %s, want %s", got, h.start)
	}
}

// A batching session (atomic transactions) holds events until
// EndTransaction; when they alone fill the window, Flush makes it send them
// (a cut, not the transaction's end), so the loop never deadlocks.
func TestBatchingSessionFlushesWhenWindowFull(t *testing.T) {
	sink := &fakeSink{batching: true}
	h := newHarness(t, Config{MaxInFlight: 2}, sink)
	x := h.tx(5)
	h.run()
	h.wal.send(x.all()...)
	h.waitStored(x.ids...)
	h.waitFlush(x.end)
	h.assertStoredOnceInOrder(x.ids...)
	_, _, seals := sink.snapshot()
	for i, u := range seals {
		if last := i == len(seals)-1; u.last != last {
			t.Fatalf("seal %d %+v: only the last unit ends the transaction", i, u)
		}
	}
	h.finished()
}

// Review case 1: in a batching session, a synchronous Publish refusal in
// the middle of a republished transaction must not seal the rows sent
// before it as a whole transaction (EndTransaction for a cut transaction).
func TestBatchingRepublishNeverSealsCutTransaction(t *testing.T) {
	sink := &fakeSink{batching: true}
	h := newHarness(t, Config{}, sink)
	x := h.tx(6)
	sink.setDecide(func(sess int, ev *decoder.Event) verdict {
		switch {
		case sess == 1:
			return fail // the first batch fails
		case sess == 2 && ev.ID == x.ids[3]:
			return refuse
		}
		return ack
	})
	h.run()
	h.wal.send(x.all()...)
	waitFor(t, "a third sink session", func() bool { _, n, _ := sink.stats(); return n >= 3 })
	h.waitStored(x.ids...)
	h.waitFlush(x.end)
	_, _, seals := sink.snapshot()
	for _, u := range seals {
		last := u.ids[len(u.ids)-1]
		h.mu.Lock()
		e := h.events[last]
		h.mu.Unlock()
		if u.last && e.index != e.rows-1 {
			t.Errorf("session %d sealed %v as a whole transaction (%s), but it has %d rows", u.sess, u.ids, u.why, e.rows)
		}
	}
	h.assertStoredOnceInOrder(x.ids...)
	h.finished()
}
