package repair

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/jetbox-dev/jetbox/sink/format"

	"github.com/jackc/pglogrepl"
	"github.com/jetbox-dev/jetbox/decoder"
	"github.com/jetbox-dev/jetbox/internal/fault"
	"github.com/rs/zerolog"
	"go.uber.org/goleak"
)

// A scripted stream: every publish the script lets through is stored (no
// duplicate window: a row sent twice is stored twice, as JetStream does once
// the window has passed), and its ack is delivered or lost as scripted.
// With ordered set it keeps the order guard's promise: after a publish of a
// session that was not stored, nothing later of that session is (its
// expected sequence no longer matches).

type verdict int

const (
	store     verdict = iota // stored, acked
	storeLost                // stored, the ack lost (done gets an error)
	fail                     // not stored, done gets an error
	refuse                   // Publish returns an error
	invalid                  // not stored: a repeated id inside the window
	permanent                // not stored: a permanent error
)

type stored struct {
	id, subject string
	pos         Position
}

type fakeStream struct {
	mu      sync.Mutex
	ordered bool
	decide  func(pass int, ev *decoder.Event) verdict
	stored  []stored
	opens   int
	openErr error
}

func (f *fakeStream) Open(context.Context) (Session, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.opens++
	if f.openErr != nil {
		return nil, f.openErr
	}
	return &fakeSession{f: f, pass: f.opens}, nil
}

func (f *fakeStream) Last(context.Context) (Position, bool, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(f.stored) == 0 {
		return Position{}, false, nil
	}
	return f.stored[len(f.stored)-1].pos, true, nil
}

func (f *fakeStream) ids() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []string
	for _, s := range f.stored {
		out = append(out, s.id)
	}
	return out
}

type fakeSession struct {
	f      *fakeStream
	pass   int
	broken bool // ordered: a publish of this session was not stored
	wg     sync.WaitGroup
}

func (s *fakeSession) Publish(ev *decoder.Event, done func(error)) error {
	f := s.f
	f.mu.Lock()
	v := store
	if f.decide != nil {
		v = f.decide(s.pass, ev)
	}
	if f.ordered && s.broken && (v == store || v == storeLost) {
		v = fail
	}
	if v != store && v != storeLost {
		s.broken = true
	}
	pos := Position{Origin: ev.Origin, CommitLSN: ev.CommitLSN, TxIndex: ev.TxIndex}
	if v == store || v == storeLost {
		f.stored = append(f.stored, stored{id: ev.ID, subject: ev.Subject, pos: pos})
	}
	f.mu.Unlock()
	var err error
	switch v {
	case refuse:
		return errors.New("fake: not connected")
	case storeLost:
		err = errors.New("fake: no PubAck (stored)")
	case fail:
		err = errors.New("fake: no PubAck")
	case invalid:
		err = &decoder.InvalidEventError{ID: ev.ID, LSN: ev.CommitLSN, TxIndex: ev.TxIndex, Code: format.ReasonDuplicateID, Column: "id", Reason: "repeated id"}
	case permanent:
		err = fault.New(errors.New("fake: stream deleted"), "restart")
	}
	s.wg.Add(1)
	go func() { defer s.wg.Done(); done(err) }() // acks come on another goroutine
	return nil
}

func (s *fakeSession) Close(context.Context) error { s.wg.Wait(); return nil }

var cols = []decoder.TableColumn{{Name: "id", TypeOID: 25}, {Name: "aggregate_type", TypeOID: 25}, {Name: "aggregate_id", TypeOID: 25},
	{Name: "event_type", TypeOID: 25}, {Name: "payload", TypeOID: 3802}, {Name: "headers", TypeOID: 3802}}

func row(id string) Row {
	return Row{Values: [][]byte{[]byte(id), []byte("order"), []byte("o-" + id), []byte("Created"), []byte(`{"id": "` + id + `"}`), nil},
		Key: time.Date(2026, 12, 1, 0, 0, 0, 0, time.UTC)}
}

func scanOf(ids ...string) Scan {
	return func(ctx context.Context, fn func(Row) error) error {
		for _, id := range ids {
			if err := fn(row(id)); err != nil {
				return err
			}
		}
		return nil
	}
}

func rows(n int) []string {
	var ids []string
	for i := range n {
		ids = append(ids, fmt.Sprintf("r%02d", i))
	}
	return ids
}

const position = pglogrepl.LSN(0x5000000 - 1)

func testConfig(t *testing.T) Config {
	t.Cleanup(func() { goleak.VerifyNone(t) })
	return Config{Decoder: decoder.Config{Schema: "public", Table: "outbox", Columns: decoder.DefaultColumns, SubjectPrefix: "outbox"},
		Columns: cols, Origin: "42/1/app/jetbox", Position: position, SinceHeader: "all", Ordered: true,
		MaxInFlight: 4, MaxBackoff: time.Millisecond, CloseTimeout: 5 * time.Second, Log: zerolog.Nop()}
}

func run(t *testing.T, st *fakeStream, scan Scan, cfg Config) (*Progress, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	prog := &Progress{}
	err := Run(ctx, st, scan, cfg, prog)
	return prog, err
}

func TestRunPublishesWhatTheStreamLacks(t *testing.T) {
	cfg := testConfig(t)
	cfg.Stored = Stored{"r01": 0, "r03": 0}
	st := &fakeStream{ordered: true}
	prog, err := run(t, st, scanOf(rows(5)...), cfg)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := st.ids(), []string{"r00", "r02", "r04"}; !slices.Equal(got, want) {
		t.Fatalf("stored %v, want %v", got, want)
	}
	for i, s := range st.stored {
		if s.pos != (Position{Origin: cfg.Origin, CommitLSN: position, TxIndex: i}) {
			t.Fatalf("row %s at %+v, want (%s, %d)", s.id, s.pos, position, i)
		}
	}
	if prog.Published.Load() != 3 || prog.Skipped.Load() != 2 {
		t.Fatalf("published %d, skipped %d; want 3, 2", prog.Published.Load(), prog.Skipped.Load())
	}
}

// Acks lost after the rows were stored: the next pass goes on after what
// the stream holds, by position, instead of storing those rows again (after
// the duplicate window JetStream would).
func TestLostAcksNotStoredTwice(t *testing.T) {
	cfg := testConfig(t)
	st := &fakeStream{ordered: true, decide: func(pass int, ev *decoder.Event) verdict {
		if pass == 1 && ev.TxIndex >= 1 {
			return storeLost
		}
		return store
	}}
	prog, err := run(t, st, scanOf(rows(3)...), cfg)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := st.ids(), rows(3); !slices.Equal(got, want) {
		t.Fatalf("stored %v, want each of %v once", got, want)
	}
	if prog.Published.Load() != 3 {
		t.Fatalf("published %d, want 3", prog.Published.Load())
	}
}

// Without the order guard the stream's last row proves nothing about the
// rows before it: lost acks are sent again (dedup mode's contract: the
// duplicate window).
func TestLostAcksUnorderedResent(t *testing.T) {
	cfg := testConfig(t)
	cfg.Ordered = false
	st := &fakeStream{decide: func(pass int, ev *decoder.Event) verdict {
		if pass == 1 && ev.TxIndex >= 1 {
			return storeLost
		}
		return store
	}}
	if _, err := run(t, st, scanOf(rows(3)...), cfg); err != nil {
		t.Fatal(err)
	}
	if got, want := st.ids(), []string{"r00", "r01", "r02", "r01", "r02"}; !slices.Equal(got, want) {
		t.Fatalf("stored %v, want %v", got, want)
	}
}

// A failed row and everything after it are published again, in order, on
// a new session; the rows acked before it are not.
func TestFailureRepublishesInOrder(t *testing.T) {
	cfg := testConfig(t)
	st := &fakeStream{ordered: true, decide: func(pass int, ev *decoder.Event) verdict {
		switch {
		case pass == 1 && ev.TxIndex == 3:
			return fail
		case pass == 1 && ev.TxIndex > 3:
			return refuse
		case pass == 2 && ev.TxIndex == 5:
			return fail // a failure in the republish too
		}
		return store
	}}
	prog, err := run(t, st, scanOf(rows(10)...), cfg)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := st.ids(), rows(10); !slices.Equal(got, want) {
		t.Fatalf("stored %v, want %v in order, once", got, want)
	}
	if prog.Published.Load() != 10 || st.opens < 3 {
		t.Fatalf("published %d in %d sessions", prog.Published.Load(), st.opens)
	}
}

// A row the sink refuses as invalid mid-pass becomes its dead letter, at
// its position, when dead-lettering is on; the repair stops on it when it
// is off.
func TestDeadLetterMidPass(t *testing.T) {
	decide := func(pass int, ev *decoder.Event) verdict {
		if ev.ID == "r02" && ev.DeadLetter == nil {
			return invalid
		}
		return store
	}
	t.Run("dead-letter", func(t *testing.T) {
		cfg := testConfig(t)
		cfg.Decoder.DeadLetterSubject = "outbox._dlq"
		st := &fakeStream{ordered: true, decide: decide}
		if _, err := run(t, st, scanOf(rows(5)...), cfg); err != nil {
			t.Fatal(err)
		}
		if got, want := st.ids(), []string{"r00", "r01", fmt.Sprintf("jetbox-dlq-%s-2", position), "r03", "r04"}; !slices.Equal(got, want) {
			t.Fatalf("stored %v, want %v", got, want)
		}
		if s := st.stored[2]; s.subject != "outbox._dlq.duplicate-id" || s.pos.TxIndex != 2 {
			t.Fatalf("dead letter on %s at %+v", s.subject, s.pos)
		}
	})
	t.Run("stop", func(t *testing.T) {
		cfg := testConfig(t)
		st := &fakeStream{ordered: true, decide: decide}
		_, err := run(t, st, scanOf(rows(5)...), cfg)
		var ie *decoder.InvalidEventError
		if !errors.As(err, &ie) || ie.ID != "r02" {
			t.Fatalf("Run returned %v, want the invalid row r02", err)
		}
		if got := st.ids(); !slices.Equal(got, []string{"r00", "r01"}) {
			t.Fatalf("stored %v: nothing after the invalid row", got)
		}
	})
}

func TestPermanentErrorStops(t *testing.T) {
	cfg := testConfig(t)
	st := &fakeStream{ordered: true, decide: func(pass int, ev *decoder.Event) verdict {
		if ev.TxIndex == 1 {
			return permanent
		}
		return store
	}}
	if _, err := run(t, st, scanOf(rows(4)...), cfg); !fault.Is(err) {
		t.Fatalf("Run returned %v, want the permanent error", err)
	}
	if st.opens != 1 {
		t.Fatalf("%d sessions: a permanent error is not retried", st.opens)
	}
}

// A session that cannot be opened for a while (NATS down) is retried.
func TestOpenRetried(t *testing.T) {
	cfg := testConfig(t)
	st := &fakeStream{ordered: true, decide: func(pass int, ev *decoder.Event) verdict {
		if pass == 1 && ev.TxIndex == 1 {
			return fail
		}
		return store
	}}
	var once sync.Once
	scan := func(ctx context.Context, fn func(Row) error) error {
		for i, id := range rows(4) {
			if i == 2 {
				once.Do(func() { st.mu.Lock(); st.openErr = errors.New("fake: NATS down"); st.mu.Unlock() })
				go func() { time.Sleep(20 * time.Millisecond); st.mu.Lock(); st.openErr = nil; st.mu.Unlock() }()
			}
			if err := fn(row(id)); err != nil {
				return err
			}
		}
		return nil
	}
	if _, err := run(t, st, scan, cfg); err != nil {
		t.Fatal(err)
	}
	if got := st.ids(); !slices.Equal(got, rows(4)) {
		t.Fatalf("stored %v", got)
	}
}

// An interrupted repair (its context ended half-way) and the re-run over
// the same range, on a new slot: the re-run skips what the first stored
// (by id) and publishes the rest, each row once.
func TestInterruptedAndResumed(t *testing.T) {
	cfg := testConfig(t)
	ids := rows(8)
	st := &fakeStream{ordered: true}
	ctx, cancel := context.WithCancel(context.Background())
	err := Run(ctx, st, func(ctx context.Context, fn func(Row) error) error {
		for i, id := range ids {
			if i == 5 {
				cancel() // killed
				return ctx.Err()
			}
			if err := fn(row(id)); err != nil {
				return err
			}
		}
		return nil
	}, cfg, &Progress{})
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("interrupted Run returned %v", err)
	}
	first := st.ids()

	// The re-run's range: the last message is the interrupted repair's.
	rg, err := PlanRange(Last{Seq: 5, CommitTime: "0001-01-01T00:00:00.000000000Z", Stored: time.Now(), RepairSince: "all"}, true, time.Time{}, false, 10*time.Minute)
	if err != nil || !rg.Resumed || !rg.Since.IsZero() {
		t.Fatalf("PlanRange = %+v, %v: want every row again", rg, err)
	}
	cfg.Stored = Stored{}
	for _, id := range first {
		cfg.Stored[id] = 0
	}
	cfg.Position += 0x1000 // the new slot's
	prog, err := run(t, st, scanOf(ids...), cfg)
	if err != nil {
		t.Fatal(err)
	}
	if got := st.ids(); !slices.Equal(got, ids) {
		t.Fatalf("stored %v, want each of %v once", got, ids)
	}
	if int(prog.Skipped.Load()) != len(first) {
		t.Fatalf("skipped %d, want the %d the first run stored", prog.Skipped.Load(), len(first))
	}
}

// A row whose id the stream holds for a message committed before the row
// was inserted is another row (an id issued again after a restore): it is
// the duplicate-id invalid row, never skipped silently.
func TestReusedIDIsNotSkipped(t *testing.T) {
	inserted := time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC)
	scan := func(ctx context.Context, fn func(Row) error) error {
		for _, id := range rows(3) {
			r := row(id)
			r.Inserted = inserted
			if err := fn(r); err != nil {
				return err
			}
		}
		return nil
	}
	stored := Stored{
		"r00": inserted.Add(time.Millisecond).UnixMicro(), // this row's message: committed after the insert
		"r01": inserted.Add(-time.Hour).UnixMicro(),       // an older row's
	}
	t.Run("stop", func(t *testing.T) {
		cfg := testConfig(t)
		cfg.Stored = stored
		st := &fakeStream{ordered: true}
		_, err := run(t, st, scan, cfg)
		var ie *decoder.InvalidEventError
		if !errors.As(err, &ie) || ie.ID != "r01" || ie.Code != format.ReasonDuplicateID {
			t.Fatalf("Run returned %v, want duplicate-id for r01", err)
		}
	})
	t.Run("dead-letter", func(t *testing.T) {
		cfg := testConfig(t)
		cfg.Stored = stored
		cfg.Decoder.DeadLetterSubject = "outbox._dlq"
		st := &fakeStream{ordered: true}
		if _, err := run(t, st, scan, cfg); err != nil {
			t.Fatal(err)
		}
		if got, want := st.ids(), []string{fmt.Sprintf("jetbox-dlq-%s-0", position), "r02"}; !slices.Equal(got, want) {
			t.Fatalf("stored %v, want %v", got, want)
		}
	})
}

func TestPlanRange(t *testing.T) {
	at := time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC)
	margin := 10 * time.Minute
	for _, c := range []struct {
		name    string
		last    Last
		hasLast bool
		since   time.Time
		all     bool
		want    time.Time // zero: every row
		resumed bool
	}{
		{"empty stream", Last{}, false, time.Time{}, false, time.Time{}, false},
		{"--all", Last{CommitTime: at.Format(time.RFC3339Nano)}, true, time.Time{}, true, time.Time{}, false},
		{"--since", Last{CommitTime: at.Format(time.RFC3339Nano)}, true, at.Add(-time.Hour), false, at.Add(-time.Hour), false},
		{"the last message's commit time", Last{CommitTime: at.Format(time.RFC3339Nano)}, true, time.Time{}, false, at.Add(-margin), false},
		{"no commit time: the store time", Last{Stored: at}, true, time.Time{}, false, at.Add(-margin), false},
		{"an interrupted repair of every row", Last{CommitTime: "0001-01-01T00:00:00.000000000Z", Stored: at, RepairSince: "all"}, true, time.Time{}, false, time.Time{}, true},
		{"an interrupted repair from a time", Last{CommitTime: at.Format(time.RFC3339Nano), RepairSince: at.Add(-2 * time.Hour).Format(time.RFC3339Nano)}, true, time.Time{}, false, at.Add(-2 * time.Hour), true},
	} {
		t.Run(c.name, func(t *testing.T) {
			rg, err := PlanRange(c.last, c.hasLast, c.since, c.all, margin)
			if err != nil {
				t.Fatal(err)
			}
			if !rg.Since.Equal(c.want) || rg.Resumed != c.resumed {
				t.Fatalf("since %s resumed %v, want %s %v", rg.Since, rg.Resumed, c.want, c.resumed)
			}
			if c.want.IsZero() != (rg.Header == "all") || (!c.want.IsZero() && !rg.ReadFrom.Equal(c.want.Add(-margin))) {
				t.Fatalf("header %q read from %s", rg.Header, rg.ReadFrom)
			}
		})
	}
	if _, err := PlanRange(Last{RepairSince: "yesterday"}, true, time.Time{}, false, margin); err == nil {
		t.Fatal("a malformed Jetbox-Repair-Since is not an error")
	}
}

func TestBaseline(t *testing.T) {
	cfg := testConfig(t)
	cfg.Atomic = true
	if NeedsBaseline(Position{Origin: cfg.Origin, CommitLSN: position - 0x100}, true, cfg) || NeedsBaseline(Position{}, false, cfg) {
		t.Fatal("no baseline after an older position of the same history, or on an empty stream")
	}
	if !NeedsBaseline(Position{Origin: "42/1/app/jetbox", CommitLSN: position + 0x100}, true, cfg) ||
		!NeedsBaseline(Position{Origin: "42/2/app/jetbox", CommitLSN: 1}, true, cfg) {
		t.Fatal("a baseline after a position at or past the repair's, or of another history")
	}
	ev, err := Baseline(cfg, "outbox", 3)
	if err != nil {
		t.Fatal(err)
	}
	var tail []string
	for _, h := range ev.Headers {
		tail = append(tail, h.Key+"="+h.Value)
	}
	if ev.Subject != "outbox._jetbox.repair" || ev.CommitLSN != position || ev.TxIndex != 0 || !slices.Contains(tail, "Jetbox-Tx-Last=true") {
		t.Fatalf("baseline %s at %s/%d with %v", ev.Subject, ev.CommitLSN, ev.TxIndex, tail)
	}
}

// A repair whose lock is lost mid-repair (another instance took over, and
// its messages made this one's guarded publish fail) stops instead of
// opening a new session and storing its old rows after the other writer's.
func TestFenceStopsRepublishAfterTakeover(t *testing.T) {
	cfg := testConfig(t)
	var mu sync.Mutex
	lost := false
	cfg.Fence = func(context.Context) error {
		mu.Lock()
		defer mu.Unlock()
		if lost {
			return errors.New("fake: the repair lock's connection is gone")
		}
		return nil
	}
	cfg.FenceEvery = time.Hour // only the forced checks, before each session
	st := &fakeStream{ordered: true, decide: func(pass int, ev *decoder.Event) verdict {
		if ev.TxIndex >= 3 {
			mu.Lock()
			lost = true // the other repair took the lock and stored first
			mu.Unlock()
			return fail
		}
		return store
	}}
	_, err := run(t, st, scanOf(rows(8)...), cfg)
	if !fault.Is(err) {
		t.Fatalf("Run returned %v, want a permanent error (the lock is lost)", err)
	}
	if st.opens != 1 {
		t.Fatalf("%d sessions: a repair without its lock opened another one", st.opens)
	}
	if got := st.ids(); !slices.Equal(got, rows(3)) {
		t.Fatalf("stored %v, want only %v", got, rows(3))
	}
}

// Without the order guard nothing makes a lockless repair's publishes
// fail: the periodic check stops it.
func TestFenceStopsUnorderedRepair(t *testing.T) {
	cfg := testConfig(t)
	cfg.Ordered = false
	checks := 0
	cfg.Fence = func(context.Context) error {
		checks++ // the scan's goroutine only
		if checks > 3 {
			return errors.New("fake: the repair lock's connection is gone")
		}
		return nil
	}
	cfg.FenceEvery = time.Nanosecond // every row
	st := &fakeStream{}
	_, err := run(t, st, scanOf(rows(8)...), cfg)
	if !fault.Is(err) {
		t.Fatalf("Run returned %v, want a permanent error (the lock is lost)", err)
	}
	if n := len(st.ids()); n > 2 {
		t.Fatalf("stored %d rows after the lock was lost (checks: open, then one per row)", n)
	}
}
