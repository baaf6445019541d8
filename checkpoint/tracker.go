// Package checkpoint decides which LSN is safe to confirm to Postgres.
//
// Events are tracked in the order they are read from the WAL and resolved
// (acked by JetStream) in any order. Commit markers carry the end LSN of each
// transaction. Safe returns the end LSN of the last transaction such that it
// and every transaction before it are fully acked. The tracker also bounds the
// work in flight: Add blocks while the window (events or bytes) is full, which
// is what keeps memory independent of transaction size.
//
// The durable checkpoint is the slot's confirmed_flush_lsn in Postgres; the
// tracker holds no state that must survive a restart.
package checkpoint

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/jackc/pglogrepl"
)

// ErrClosed is returned by Add once the tracker has been closed.
var ErrClosed = errors.New("checkpoint tracker closed")

// Ticket identifies one tracked event; pass it to Done or Fail.
type Ticket uint64

type entry struct {
	commit bool          // a commit marker rather than an event
	done   bool          // event resolved successfully
	size   int           // bytes the event holds while in flight
	end    pglogrepl.LSN // for commit markers: the transaction end LSN
}

// Tracker is safe for concurrent use: one goroutine adds events and commits,
// any goroutine resolves them.
type Tracker struct {
	mu       sync.Mutex
	entries  []entry // entries[0] has ticket base
	base     Ticket
	safe     pglogrepl.LSN
	events   int // events in entries (resolved or not)
	bytes    int // bytes of unresolved events
	maxEvent int
	maxBytes int
	err      error
	closed   bool
	room     chan struct{} // closed and replaced when room frees and someone waits
	waiting  bool
}

// New returns a tracker whose safe position starts at start (the slot's
// confirmed_flush_lsn) and which admits at most maxEvents events and maxBytes
// bytes in flight. A maxBytes of 0 means no byte bound.
func New(start pglogrepl.LSN, maxEvents, maxBytes int) *Tracker {
	if maxEvents < 1 {
		maxEvents = 1
	}
	return &Tracker{safe: start, maxEvent: maxEvents, maxBytes: maxBytes, room: make(chan struct{})}
}

// Add tracks one event of size bytes. It blocks while the window is full,
// until room frees, ctx ends, a tracked event failed, or the tracker closed.
// A single event larger than the byte window is admitted when nothing else is
// in flight, so an oversized event can never wedge the pipeline.
func (t *Tracker) Add(ctx context.Context, size int) (Ticket, error) {
	for {
		if ticket, ok, err := t.TryAdd(size); ok || err != nil {
			return ticket, err
		}
		t.mu.Lock()
		if t.fits(size) || t.err != nil || t.closed {
			t.mu.Unlock() // changed since TryAdd: try again
			continue
		}
		room := t.room
		t.waiting = true
		t.mu.Unlock()
		select {
		case <-room:
		case <-ctx.Done():
			return 0, ctx.Err()
		}
	}
}

// TryAdd is Add without blocking: ok is false when the window is full.
func (t *Tracker) TryAdd(size int) (ticket Ticket, ok bool, err error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	switch {
	case t.err != nil:
		return 0, false, t.err
	case t.closed:
		return 0, false, ErrClosed
	case !t.fits(size):
		return 0, false, nil
	}
	ticket = t.base + Ticket(len(t.entries))
	t.entries = append(t.entries, entry{size: size})
	t.events++
	t.bytes += size
	return ticket, true, nil
}

func (t *Tracker) fits(size int) bool {
	if t.events >= t.maxEvent {
		return false
	}
	if t.maxBytes > 0 && t.bytes+size > t.maxBytes && t.events > 0 {
		return false
	}
	return true
}

// Commit records the end of a transaction whose events were all added before
// it. With nothing in flight the safe position moves at once.
func (t *Tracker) Commit(end pglogrepl.LSN) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if len(t.entries) == 0 {
		if end > t.safe {
			t.safe = end
		}
		return
	}
	t.entries = append(t.entries, entry{commit: true, end: end})
}

// Done marks the event as stored. Unknown or repeated tickets are ignored.
func (t *Tracker) Done(ticket Ticket) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if ticket < t.base || ticket >= t.base+Ticket(len(t.entries)) {
		return
	}
	e := &t.entries[ticket-t.base]
	if e.commit || e.done {
		return
	}
	e.done = true
	t.bytes -= e.size
	t.advance()
}

// Fail records that the event was not (or not provably) stored. The first
// failure is kept: Add and Err return it from then on, and the safe position
// never passes the failed event.
func (t *Tracker) Fail(ticket Ticket, err error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.err == nil {
		t.err = fmt.Errorf("event %d: %w", ticket, err)
		t.waiting = true
		t.wake()
	}
}

// advance pops resolved events and commit markers from the head. Called with mu held.
func (t *Tracker) advance() {
	n := 0
	for n < len(t.entries) {
		e := t.entries[n]
		if e.commit {
			if e.end > t.safe {
				t.safe = e.end
			}
		} else if !e.done {
			break
		} else {
			t.events--
		}
		n++
	}
	if n == 0 {
		return
	}
	t.base += Ticket(n)
	t.entries = t.entries[n:]
	if len(t.entries) == 0 {
		t.entries = t.entries[:0:0] // release the backing array of a drained window
	} else if cap(t.entries) > 2*t.maxEvent+64 && len(t.entries) < cap(t.entries)/4 {
		t.entries = append([]entry(nil), t.entries...)
	}
	t.wake()
}

func (t *Tracker) wake() {
	if !t.waiting {
		return
	}
	t.waiting = false
	close(t.room)
	t.room = make(chan struct{})
}

// Safe returns the highest LSN that may be confirmed: the end of the last
// transaction that is fully acked along with every transaction before it.
func (t *Tracker) Safe() pglogrepl.LSN {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.safe
}

// Idle reports whether nothing is in flight and no commit is pending.
func (t *Tracker) Idle() bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.entries) == 0 && t.err == nil
}

// AdvanceIdle moves the safe position to lsn if nothing is in flight. The
// caller must also know that no transaction is open (between Begin and
// Commit); it uses this for positions reported by server keepalives.
func (t *Tracker) AdvanceIdle(lsn pglogrepl.LSN) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	if len(t.entries) != 0 || t.err != nil || lsn <= t.safe {
		return false
	}
	t.safe = lsn
	return true
}

// InFlight returns the number of tracked events not yet popped and the bytes
// of those not yet resolved.
func (t *Tracker) InFlight() (events, bytes int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.events, t.bytes
}

// Err returns the first failure recorded by Fail, or nil.
func (t *Tracker) Err() error {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.err
}

// Close wakes any blocked Add; later Adds return ErrClosed.
func (t *Tracker) Close() {
	t.mu.Lock()
	defer t.mu.Unlock()
	if !t.closed {
		t.closed = true
		t.waiting = true
		t.wake()
	}
}
