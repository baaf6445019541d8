package checkpoint

import (
	"context"
	"errors"
	"math/rand"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func add(t *testing.T, tr *Tracker[string], payload string) Ticket {
	t.Helper()
	tk, err := tr.Add(context.Background(), 10, payload)
	if err != nil {
		t.Fatal(err)
	}
	return tk
}

func TestSafeMovesOnlyOverFullyAckedPrefix(t *testing.T) {
	tr := New[string](100, 10, 0)
	a1 := add(t, tr, "a1")
	a2 := add(t, tr, "a2")
	tr.Commit(200)
	b1 := add(t, tr, "b1")
	tr.Commit(300)
	c1 := add(t, tr, "c1")
	tr.Commit(400)

	steps := []struct {
		ack  Ticket
		want pglogrepl.LSN
	}{
		{b1, 100}, // later transaction acked first: nothing moves
		{a2, 100}, // first transaction half acked
		{c1, 100},
		{a1, 400}, // the prefix closes: everything is safe at once
	}
	for i, s := range steps {
		tr.Done(s.ack)
		if got := tr.Safe(); got != s.want {
			t.Fatalf("step %d: Safe() = %s, want %s", i, got, s.want)
		}
	}
	if ev, _ := tr.InFlight(); ev != 0 {
		t.Fatalf("%d events left in the window", ev)
	}
}

func TestCommitWithEmptyWindowMovesAtOnce(t *testing.T) {
	tr := New[string](100, 10, 0)
	tr.Commit(150) // an empty transaction (Postgres < 15 sends them)
	if tr.Safe() != 150 {
		t.Fatalf("Safe() = %s", tr.Safe())
	}
	tr.Commit(120) // never backwards
	if tr.Safe() != 150 {
		t.Fatalf("Safe() moved back to %s", tr.Safe())
	}
}

func TestAdvanceIdleOnlyWhenWindowEmpty(t *testing.T) {
	tr := New[string](100, 10, 0)
	tk := add(t, tr, "")
	if tr.AdvanceIdle(500) || tr.Safe() != 100 {
		t.Fatalf("keepalive adopted with an event in flight: %s", tr.Safe())
	}
	tr.Done(tk)
	// Acked but its commit not seen yet: the window is empty, the caller
	// knows whether a transaction is open.
	if !tr.AdvanceIdle(500) || tr.Safe() != 500 {
		t.Fatalf("keepalive not adopted when idle: %s", tr.Safe())
	}
	if tr.AdvanceIdle(400) || tr.Safe() != 500 {
		t.Fatal("AdvanceIdle moved backwards")
	}
}

func TestFailedEventHoldsTheWindowUntilRequeued(t *testing.T) {
	tr := New[string](100, 10, 0)
	a := add(t, tr, "a")
	b := add(t, tr, "b")
	c := add(t, tr, "c")
	tr.Commit(200)
	tr.Done(a)
	tr.Fail(b, errors.New("disconnected"))
	tr.Done(c)
	if n, err := tr.Failures(); n != 1 || err == nil {
		t.Fatalf("Failures() = %d, %v", n, err)
	}
	if tr.Safe() != 100 {
		t.Fatalf("Safe() passed a failed event: %s", tr.Safe())
	}
	r := tr.Requeue()
	if len(r) != 1 || r[0].Ticket != b || r[0].Payload != "b" || r[0].Err == nil || r[0].Err.Error() != "disconnected" {
		t.Fatalf("Requeue() = %+v", r)
	}
	if n, _ := tr.Failures(); n != 0 {
		t.Fatal("failures not cleared by Requeue")
	}
	tr.Done(b)
	if tr.Safe() != 200 {
		t.Fatalf("Safe() = %s after the retry was acked", tr.Safe())
	}
}

func TestFailPendingAbandonsInFlight(t *testing.T) {
	tr := New[string](0, 10, 0)
	a := add(t, tr, "a")
	add(t, tr, "b")
	tr.Done(a)
	tr.FailPending(errors.New("abandoned"))
	r := tr.Requeue()
	if len(r) != 1 || r[0].Payload != "b" || r[0].Err == nil {
		t.Fatalf("Requeue() = %+v", r)
	}
	tr.Done(a) // a stale ack for an already popped ticket is ignored
}

func TestAddBlocksWhenFullAndReportsFailures(t *testing.T) {
	tr := New[string](0, 2, 0)
	a := add(t, tr, "")
	b := add(t, tr, "")
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	if _, err := tr.Add(ctx, 10, ""); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Add on a full window: %v, want it to block until ctx ends", err)
	}
	got := make(chan error, 1)
	go func() {
		_, err := tr.Add(context.Background(), 10, "")
		got <- err
	}()
	tr.Fail(b, errors.New("boom")) // a failure must wake a blocked Add
	if err := <-got; !errors.Is(err, ErrFailures) {
		t.Fatalf("blocked Add returned %v, want ErrFailures", err)
	}
	tr.Requeue()
	go func() {
		_, err := tr.Add(context.Background(), 10, "")
		got <- err
	}()
	tr.Done(a) // room frees
	if err := <-got; err != nil {
		t.Fatal(err)
	}
	tr.Close()
	if _, err := tr.Add(context.Background(), 10, ""); !errors.Is(err, ErrClosed) {
		t.Fatalf("Add after Close: %v", err)
	}
}

func TestByteBound(t *testing.T) {
	tr := New[string](0, 100, 1000)
	big, ok, _ := tr.TryAdd(5000, "") // larger than the bound: admitted alone
	if !ok {
		t.Fatal("an oversized event must be admitted into an empty window")
	}
	if _, ok, _ := tr.TryAdd(10, ""); ok {
		t.Fatal("admitted past the byte bound")
	}
	tr.Done(big)
	if _, ok, _ := tr.TryAdd(600, ""); !ok {
		t.Fatal("room not freed")
	}
	if _, ok, _ := tr.TryAdd(600, ""); ok {
		t.Fatal("admitted past the byte bound")
	}
}

func TestWaitResolved(t *testing.T) {
	tr := New[string](0, 10, 0)
	a := add(t, tr, "")
	b := add(t, tr, "")
	done := make(chan error, 1)
	go func() { done <- tr.WaitResolved(context.Background()) }()
	tr.Done(a)
	tr.Fail(b, errors.New("x"))
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

// TestRandomOrderProperty resolves events in random order from several
// goroutines and checks Safe never passes an unacked transaction and ends at
// the last commit.
func TestRandomOrderProperty(t *testing.T) {
	rng := rand.New(rand.NewSource(time.Now().UnixNano()))
	for round := 0; round < 50; round++ {
		tr := New[string](0, 1<<20, 0)
		type txn struct {
			tickets []Ticket
			end     pglogrepl.LSN
		}
		var txns []txn
		var mu sync.Mutex
		acked := map[Ticket]bool{}
		var wg sync.WaitGroup
		ackCh := make(chan Ticket, 1024)
		for w := 0; w < 4; w++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for tk := range ackCh {
					mu.Lock()
					acked[tk] = true
					mu.Unlock()
					tr.Done(tk)
				}
			}()
		}
		var lsn pglogrepl.LSN
		var pending []Ticket
		for i := 0; i < 200; i++ {
			var tx txn
			for j := 0; j < rng.Intn(5); j++ {
				tk, err := tr.Add(context.Background(), 1, "")
				if err != nil {
					t.Fatal(err)
				}
				tx.tickets = append(tx.tickets, tk)
				pending = append(pending, tk)
			}
			lsn += pglogrepl.LSN(1 + rng.Intn(100))
			tx.end = lsn
			tr.Commit(lsn)
			txns = append(txns, tx)
			// resolve a random subset, in random order
			rng.Shuffle(len(pending), func(a, b int) { pending[a], pending[b] = pending[b], pending[a] })
			k := rng.Intn(len(pending) + 1)
			for _, tk := range pending[:k] {
				ackCh <- tk
			}
			pending = append([]Ticket(nil), pending[k:]...)

			// invariant: every transaction ending at or before Safe is fully acked
			safe := tr.Safe()
			mu.Lock()
			for _, tx := range txns {
				if tx.end > safe {
					break
				}
				for _, tk := range tx.tickets {
					if !acked[tk] {
						mu.Unlock()
						t.Fatalf("Safe() = %s covers transaction ending %s with ticket %d unacked", safe, tx.end, tk)
					}
				}
			}
			mu.Unlock()
		}
		for _, tk := range pending {
			ackCh <- tk
		}
		close(ackCh)
		wg.Wait()
		if tr.Safe() != lsn {
			t.Fatalf("all acked but Safe() = %s, want %s", tr.Safe(), lsn)
		}
	}
}

func BenchmarkTrackAckCommit(b *testing.B) {
	tr := New[string](0, 1024, 0)
	b.ReportAllocs()
	for i := 0; i < b.N; i++ {
		tk, _, _ := tr.TryAdd(100, "")
		tr.Done(tk)
		tr.Commit(pglogrepl.LSN(i + 1))
	}
}

func BenchmarkTrackPipelined(b *testing.B) {
	tr := New[string](0, 1024, 0)
	tickets := make([]Ticket, 0, 512)
	b.ReportAllocs()
	for i := 0; i < b.N; i++ {
		tk, _, _ := tr.TryAdd(100, "")
		tickets = append(tickets, tk)
		if len(tickets) == cap(tickets) {
			for _, tk := range tickets {
				tr.Done(tk)
			}
			tickets = tickets[:0]
			tr.Commit(pglogrepl.LSN(i + 1))
		}
	}
}

func TestConsecutiveCommitsCollapse(t *testing.T) {
	tr := New[string](0, 10, 0)
	e := add(t, tr, "")
	for lsn := pglogrepl.LSN(100); lsn <= 1000; lsn += 100 {
		tr.Commit(lsn) // empty transactions behind a pending event
	}
	tr.mu.Lock()
	n := len(tr.entries)
	tr.mu.Unlock()
	if n != 2 {
		t.Fatalf("%d entries for one event and ten commits, want 2", n)
	}
	tr.Done(e)
	if tr.Safe() != 1000 {
		t.Fatalf("Safe() = %s", tr.Safe())
	}
}

// TestBlocked: Blocked holds from an add that found no room until there is
// room for that event again or an add fits.
func TestBlocked(t *testing.T) {
	tr := New[string](0, 2, 100)
	if tr.Blocked() {
		t.Fatal("blocked before any add")
	}
	a := add(t, tr, "a")
	if _, ok, _ := tr.TryAdd(95, "big"); ok || !tr.Blocked() {
		t.Fatalf("an event over the byte window: ok=%v blocked=%v", ok, tr.Blocked())
	}
	tr.Done(a) // the window empties: the big event fits now
	if tr.Blocked() {
		t.Fatal("still blocked with room for the event")
	}
	b := add(t, tr, "b")
	add(t, tr, "c")
	if _, ok, _ := tr.TryAdd(1, "d"); ok || !tr.Blocked() {
		t.Fatal("a full event window is not blocked")
	}
	tr.Done(b)
	if _, ok, _ := tr.TryAdd(1, "d"); !ok || tr.Blocked() {
		t.Fatal("an add that fits leaves it blocked")
	}
}

// TestWaitResolvedBefore waits for the events before a ticket only.
func TestWaitResolvedBefore(t *testing.T) {
	tr := New[string](0, 10, 0)
	a := add(t, tr, "a")
	b := add(t, tr, "b")
	tr.Commit(10)
	c := add(t, tr, "c")
	done := make(chan error, 1)
	go func() { done <- tr.WaitResolvedBefore(context.Background(), c) }()
	tr.Done(b)
	tr.Fail(a, errors.New("x"))
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	if err := tr.WaitResolvedBefore(ctx, c+1); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("returned %v with c in flight", err)
	}
}

func TestFailedErrorsInWindowOrder(t *testing.T) {
	tr := New[int](0, 10, 0)
	var tickets []Ticket
	for i := range 3 {
		tk, ok, err := tr.TryAdd(1, i)
		if !ok || err != nil {
			t.Fatal(ok, err)
		}
		tickets = append(tickets, tk)
	}
	e1, e2 := errors.New("second"), errors.New("first")
	tr.Fail(tickets[2], e1)
	tr.Done(tickets[1])
	tr.Fail(tickets[0], e2)
	if n, err := tr.Failures(); n != 2 || err != e1 {
		t.Fatalf("Failures() = %d, %v: want 2 and the first reported", n, err)
	}
	if got := tr.FailedErrors(); len(got) != 2 || got[0] != e2 || got[1] != e1 {
		t.Fatalf("FailedErrors() = %v, want window order", got)
	}
}
