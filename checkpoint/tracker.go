// Package checkpoint decides which LSN is safe to confirm to Postgres.
//
// Events are tracked in the order they are read from the WAL and resolved
// (acked by JetStream, or failed) in any order. Commit markers carry the end
// LSN of each transaction. Safe returns the end LSN of the last transaction
// such that it and every transaction before it are fully acked. The tracker
// also bounds the work in flight: Add blocks while the window (events or
// bytes) is full, which keeps memory independent of transaction size.
//
// A failed event stays in the window, with the payload it was added with,
// until Requeue hands it back for publishing again: nothing after it can be
// confirmed before it is acked, and it is never dropped.
//
// The durable checkpoint is the slot's confirmed_flush_lsn in Postgres; the
// tracker holds no state that must survive a restart.
package checkpoint

import (
	"context"
	"errors"
	"sync"

	"github.com/jackc/pglogrepl"
)

// ErrClosed is returned by Add once the tracker has been closed.
var ErrClosed = errors.New("checkpoint tracker closed")

// Ticket identifies one tracked event; pass it to Done or Fail.
type Ticket uint64

type state uint8

const (
	pending state = iota // in flight
	done                 // stored
	failed               // not stored, or outcome unknown: to publish again
)

type entry[T any] struct {
	commit  bool          // a commit marker rather than an event
	state   state         // of an event
	size    int           // bytes the event holds while in the window
	end     pglogrepl.LSN // of a commit marker: the transaction end LSN
	payload T             // what Add was given, handed back by Requeue
	err     error         // why a failed event failed
}

// Tracker is safe for concurrent use: one goroutine adds events and commits,
// any goroutine resolves them. T is the type of the payload each event is
// added with and Requeue hands back.
type Tracker[T any] struct {
	mu       sync.Mutex
	entries  []entry[T] // entries[0] has ticket base
	base     Ticket
	safe     pglogrepl.LSN
	events   int // events in the window (any state)
	bytes    int // bytes of events in the window
	pending  int // events in flight
	failed   int // events failed and not yet requeued
	lastErr  error
	maxEvent int
	maxBytes int
	closed   bool
	changed  chan struct{} // closed and replaced on a change someone waits for
	waiting  bool
	want     int // size the last TryAdd found no room for; -1 after one that fit
}

// New returns a tracker whose safe position starts at start (the slot's
// confirmed_flush_lsn) and which admits at most maxEvents events and maxBytes
// bytes in its window. A maxBytes of 0 means no byte bound.
func New[T any](start pglogrepl.LSN, maxEvents, maxBytes int) *Tracker[T] {
	if maxEvents < 1 {
		maxEvents = 1
	}
	return &Tracker[T]{safe: start, maxEvent: maxEvents, maxBytes: maxBytes, changed: make(chan struct{}), want: -1}
}

// TryAdd is Add without blocking: ok is false when the window is full.
func (t *Tracker[T]) TryAdd(size int, payload T) (ticket Ticket, ok bool, err error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return 0, false, ErrClosed
	}
	if !t.fits(size) {
		t.want = size
		return 0, false, nil
	}
	t.want = -1
	ticket = t.base + Ticket(len(t.entries))
	t.entries = append(t.entries, entry[T]{size: size, payload: payload})
	t.events++
	t.pending++
	t.bytes += size
	return ticket, true, nil
}

// Add tracks one in-flight event of size bytes. It blocks while the window is
// full, until room frees, ctx ends or the tracker closes. An event larger than
// the byte window is admitted when the window is empty, so one big event can
// never wedge the pipeline. While failed events await Requeue it returns
// ErrFailures instead of blocking: they hold the window until republished.
func (t *Tracker[T]) Add(ctx context.Context, size int, payload T) (Ticket, error) {
	for {
		if ticket, ok, err := t.TryAdd(size, payload); ok || err != nil {
			return ticket, err
		}
		if err := t.wait(ctx, func() bool { return t.fits(size) || t.closed || t.failed > 0 }); err != nil {
			return 0, err
		}
		if n, _ := t.Failures(); n > 0 {
			return 0, ErrFailures
		}
	}
}

// ErrFailures is returned by Add while failed events await Requeue.
var ErrFailures = errors.New("failed events await republishing")

// WaitResolved blocks until no event is in flight (each is done or failed).
func (t *Tracker[T]) WaitResolved(ctx context.Context) error {
	return t.wait(ctx, func() bool { return t.pending == 0 || t.closed })
}

// WaitResolvedBefore blocks until every event tracked before ticket is done
// or failed (events from ticket on may still be in flight).
func (t *Tracker[T]) WaitResolvedBefore(ctx context.Context, ticket Ticket) error {
	return t.wait(ctx, func() bool {
		if t.closed {
			return true
		}
		for i := 0; i < len(t.entries) && t.base+Ticket(i) < ticket; i++ {
			if e := &t.entries[i]; !e.commit && e.state == pending {
				return false
			}
		}
		return true
	})
}

// Blocked reports whether the last TryAdd (or Add) found no room and there
// is still none for that event: its caller waits, and only events in the
// window being resolved can let it go on. It is false once an add fits.
// Safe for any goroutine; a batching sink uses it to tell when it must send
// events it holds back (see replication.Session.Flush).
func (t *Tracker[T]) Blocked() bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.want >= 0 && !t.closed && !t.fits(t.want)
}

// wait blocks until cond (called with mu held) holds or ctx ends.
func (t *Tracker[T]) wait(ctx context.Context, cond func() bool) error {
	for {
		t.mu.Lock()
		if cond() {
			t.mu.Unlock()
			return nil
		}
		ch := t.changed
		t.waiting = true
		t.mu.Unlock()
		select {
		case <-ch:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

func (t *Tracker[T]) fits(size int) bool {
	if t.events >= t.maxEvent {
		return false
	}
	return t.maxBytes <= 0 || t.events == 0 || t.bytes+size <= t.maxBytes
}

// Commit records the end of a transaction whose events were all added before
// it. With nothing in the window the safe position moves at once.
func (t *Tracker[T]) Commit(end pglogrepl.LSN) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if len(t.entries) == 0 {
		if end > t.safe {
			t.safe = end
		}
		return
	}
	// Consecutive commits (transactions without events, e.g. the empty ones
	// of Postgres < 15) collapse into one marker: the window stays bounded.
	if last := &t.entries[len(t.entries)-1]; last.commit {
		if end > last.end {
			last.end = end
		}
		return
	}
	t.entries = append(t.entries, entry[T]{commit: true, end: end})
}

// Done marks the in-flight event as stored. Other tickets are ignored.
func (t *Tracker[T]) Done(ticket Ticket) {
	t.mu.Lock()
	defer t.mu.Unlock()
	e := t.inFlight(ticket)
	if e == nil {
		return
	}
	e.state = done
	t.pending--
	t.advance()
	t.wake()
}

// Fail marks the in-flight event as not stored (or not provably stored). It
// stays in the window until Requeue returns it. err is kept for Failures.
func (t *Tracker[T]) Fail(ticket Ticket, err error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	e := t.inFlight(ticket)
	if e == nil {
		return
	}
	e.state, e.err = failed, err
	t.pending--
	t.failed++
	if t.lastErr == nil {
		t.lastErr = err
	}
	t.wake()
}

func (t *Tracker[T]) inFlight(ticket Ticket) *entry[T] {
	if ticket < t.base || ticket >= t.base+Ticket(len(t.entries)) {
		return nil
	}
	e := &t.entries[ticket-t.base]
	if e.commit || e.state != pending {
		return nil
	}
	return e
}

// FailPending fails every event still in flight: its acks will never come
// (the session that published it was abandoned).
func (t *Tracker[T]) FailPending(err error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for i := range t.entries {
		if e := &t.entries[i]; !e.commit && e.state == pending {
			e.state, e.err = failed, err
			t.failed++
			if t.lastErr == nil {
				t.lastErr = err
			}
		}
	}
	t.pending = 0
	t.wake()
}

// Failures returns the number of failed events awaiting Requeue and the
// first error among them (the first reported).
func (t *Tracker[T]) Failures() (int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.failed, t.lastErr
}

// FailedErrors returns the errors of the failed events awaiting Requeue,
// in window order.
func (t *Tracker[T]) FailedErrors() []error {
	t.mu.Lock()
	defer t.mu.Unlock()
	var errs []error
	for i := range t.entries {
		if e := &t.entries[i]; !e.commit && e.state == failed {
			errs = append(errs, e.err)
		}
	}
	return errs
}

// Retry is a failed event handed back for publishing again.
type Retry[T any] struct {
	Ticket  Ticket
	Payload T
	Err     error // why it failed
}

// Requeue returns the failed events in window order and puts them back in
// flight; publish each again and resolve it with Done or Fail.
func (t *Tracker[T]) Requeue() []Retry[T] {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := make([]Retry[T], 0, t.failed)
	for i := range t.entries {
		if e := &t.entries[i]; !e.commit && e.state == failed {
			out = append(out, Retry[T]{Ticket: t.base + Ticket(i), Payload: e.payload, Err: e.err})
			e.state, e.err = pending, nil
		}
	}
	t.pending += len(out)
	t.failed, t.lastErr = 0, nil
	return out
}

// advance pops stored events and commit markers from the head. mu is held.
func (t *Tracker[T]) advance() {
	n := 0
	for ; n < len(t.entries); n++ {
		e := &t.entries[n]
		if e.commit {
			if e.end > t.safe {
				t.safe = e.end
			}
			continue
		}
		if e.state != done {
			break
		}
		t.events--
		t.bytes -= e.size
		var zero T
		e.payload = zero // the window no longer holds it
	}
	if n == 0 {
		return
	}
	t.base += Ticket(n)
	t.entries = t.entries[n:]
	if len(t.entries) == 0 {
		t.entries = nil // release the backing array of a drained window
	} else if cap(t.entries) > 4*t.maxEvent+64 && len(t.entries) < cap(t.entries)/4 {
		t.entries = append([]entry[T](nil), t.entries...)
	}
}

func (t *Tracker[T]) wake() {
	if !t.waiting {
		return
	}
	t.waiting = false
	close(t.changed)
	t.changed = make(chan struct{})
}

// Safe returns the highest LSN that may be confirmed: the end of the last
// transaction that is fully acked along with every transaction before it.
func (t *Tracker[T]) Safe() pglogrepl.LSN {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.safe
}

// AdvanceIdle moves the safe position to lsn if the window is empty. The
// caller must also know no transaction is open (between Begin and Commit); it
// uses this for positions reported by server keepalives.
func (t *Tracker[T]) AdvanceIdle(lsn pglogrepl.LSN) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	if len(t.entries) != 0 || lsn <= t.safe {
		return false
	}
	t.safe = lsn
	return true
}

// InFlight returns the events in the window (not yet popped) and their bytes.
func (t *Tracker[T]) InFlight() (events, bytes int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.events, t.bytes
}

// Close wakes every waiter; later Adds return ErrClosed.
func (t *Tracker[T]) Close() {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.closed = true
	t.waiting = true
	t.wake()
}
