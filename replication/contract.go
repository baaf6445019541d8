package replication

import (
	"context"

	"github.com/jackc/pglogrepl"
	"github.com/jetbox-dev/jetbox/decoder"
)

// Sink is where events go: one Session per replication session, and a new
// one after publish failures. Open is called only while the replication
// session holds the slot (START_REPLICATION succeeded): a standby opens
// none. Open may fail (the stream is unreachable); an error that
// implements Permanent() true stops jetbox.
type Sink interface {
	// Open starts a session for events from source (see decoder.Event.Origin).
	Open(ctx context.Context, source string) (PublishSession, error)
}

// PublishSession publishes the events of one replication session.
type PublishSession interface {
	// Publish sends ev. done is called exactly once, with nil once JetStream
	// stored it, unless Close gave up waiting. A returned error means ev was
	// not sent and done will not be called.
	Publish(ev *decoder.Event, done func(error)) error
	// EndTransaction says the events published since the previous one
	// complete a transaction. A session that publishes whole transactions
	// as atomic batches holds a transaction's events until then.
	EndTransaction()
	// Flush is called when the window is full, before the loop waits for
	// room. blocked (safe for any goroutine) reports whether the loop still
	// waits with no room: a session holding events back sends them once
	// nothing else it sent can free the window, so the wait cannot deadlock.
	Flush(blocked func() bool)
	// Close waits (bounded by ctx) until every done was called.
	Close(ctx context.Context) error
}

// HeldSkipper is a Session that can tell, by position alone, an event the
// stream already holds. The loop asks it about a row that cannot be
// published under --on-invalid=stop: an earlier run under
// --on-invalid=dead-letter may have stored its dead letter before the slot
// confirmed it, and its replay is then skipped rather than stopped on.
type HeldSkipper interface {
	// SkipHeld reports whether the stream holds this session's event at
	// (lsn, txIndex); if so it counts the event as a skipped replay.
	SkipHeld(lsn pglogrepl.LSN, txIndex int) bool
}
