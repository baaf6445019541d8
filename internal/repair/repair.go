// Package repair publishes the outbox rows a stream misses, read from a
// snapshot of the table, for jetbox repair (docs/operations.md, "Repair and
// backfill").
//
// The snapshot is the one a new slot exported at its consistent point C:
// it holds every row committed before C, and the slot streams every row
// committed from C on. Each row the stream lacks is published at position
// (C - 1, k), k = 0, 1, ... in the repair order: after everything the
// stream held, before everything the slot streams, so jetbox run's skip by
// position never takes a repaired row for a replay, or a slot's event for
// a repaired one.
//
// Publishing is pipelined: a checkpoint.Tracker bounds the window and keeps
// every failed row, in order, until it is stored. After a failure the
// session is closed, and the failed rows are published again on a new one,
// in order; with the order guard (Config.Ordered) the rows the stream
// stored although their acks were lost are found by position first and not
// sent again (after the duplicate window JetStream would store them twice).
package repair

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/jetbox-dev/jetbox/sink/format"

	"github.com/jackc/pglogrepl"
	"github.com/jetbox-dev/jetbox/checkpoint"
	"github.com/jetbox-dev/jetbox/decoder"
	"github.com/jetbox-dev/jetbox/internal/fault"
	"github.com/jetbox-dev/jetbox/internal/wait"
	"github.com/rs/zerolog"
)

// Header names of the messages a repair stores (the sink's, repeated here so
// that this package needs nothing of NATS).
const (
	HeaderRepaired    = "Jetbox-Repaired"
	HeaderRepairSince = "Jetbox-Repair-Since"
	HeaderTxLast      = "Jetbox-Tx-Last"
)

// Session publishes one pass of a repair (sink.Session). done is called
// once per published event, in publish order, unless Close gives up.
type Session interface {
	Publish(ev *decoder.Event, done func(error)) error
	Close(ctx context.Context) error
}

// Stream is the stream side of a repair.
type Stream interface {
	// Open starts a publishing session for the repair's source.
	Open(ctx context.Context) (Session, error)
	// Last returns the last message the repair's writer (its database and
	// slot) stored; ok is false when there is none.
	Last(ctx context.Context) (pos Position, ok bool, err error)
}

// Position is where a stored message sits in its writer's history.
type Position struct {
	Origin    string // Jetbox-Source
	CommitLSN pglogrepl.LSN
	TxIndex   int
}

// Row is one outbox row of the snapshot.
type Row struct {
	Values [][]byte  // the columns' text output, nil for NULL, in Config.Columns order
	Key    time.Time // the repair order key (zero: the row has none)
	// Inserted is the row's insert time (the created-at column), zero when
	// the table has none.
	Inserted time.Time
}

// Scan calls fn for every row of the range, in the repair order; an error
// from fn stops it and is returned.
type Scan func(ctx context.Context, fn func(Row) error) error

// Config configures Run.
type Config struct {
	Decoder decoder.Config // the run's, dead-letter subject included
	Columns []decoder.TableColumn
	// Origin is the new slot's Jetbox-Source; Position is the commit LSN of
	// every repaired row: the slot's consistent point - 1.
	Origin   string
	Position pglogrepl.LSN
	// SinceHeader is the Jetbox-Repair-Since of every message (Range.Header).
	SinceHeader string
	// Stored holds the rows the stream has (StoredIDs), skipped; a stored
	// id whose message committed more than Skew before the row was
	// inserted is another row's (an id issued again), the duplicate-id
	// invalid row.
	Stored Stored
	Skew   time.Duration
	// Atomic: each repaired row carries Jetbox-Tx-Last (it stands alone).
	Atomic bool
	// Ordered: the stream holds this session's messages in position order
	// (exactly-once, or dedup with the order guard).
	Ordered bool

	MaxInFlight      int
	MaxInFlightBytes int
	// Fence, if set, says whether this repair may still publish: the
	// repair lock is still held (replication.RepairLock.Check). It is
	// called before every publishing session is opened (the first, and
	// each one after a failure) and at least every FenceEvery while rows
	// are published; an error stops the repair at once, unretried. Without
	// it, a repair whose lock was lost (its connection cut, a takeover by
	// another instance) would reopen sessions after the other writer's
	// messages made its guarded publishes fail, and store its old rows
	// after them: out of order, and twice once the window has passed.
	Fence      func(ctx context.Context) error
	FenceEvery time.Duration // 0: DefaultFenceEvery
	// CloseTimeout bounds the wait for a failed pass's acks.
	CloseTimeout time.Duration
	MaxBackoff   time.Duration
	Log          zerolog.Logger
}

// Progress counts what Run did, for a progress printer.
type Progress struct {
	Published atomic.Int64 // stored by this repair
	Skipped   atomic.Int64 // already in the stream
}

// DefaultFenceEvery is how often a repair checks its Fence while it
// publishes (Config.FenceEvery).
const DefaultFenceEvery = time.Second

// errAbandoned fails the rows of a pass that was given up.
var errAbandoned = errors.New("the publishing session was abandoned before its ack")

// Run publishes every row of scan the stream lacks and returns once each is
// stored. It stops on an invalid row it may not dead-letter (an
// *decoder.InvalidEventError), on a permanent error (fault.Is), or when ctx
// ends; other failures are retried with backoff.
func Run(ctx context.Context, st Stream, scan Scan, cfg Config, prog *Progress) error {
	if cfg.MaxInFlight < 1 {
		cfg.MaxInFlight = 1
	}
	if cfg.MaxBackoff <= 0 {
		cfg.MaxBackoff = 30 * time.Second
	}
	if cfg.CloseTimeout <= 0 {
		cfg.CloseTimeout = 30 * time.Second
	}
	if cfg.FenceEvery <= 0 {
		cfg.FenceEvery = DefaultFenceEvery
	}
	r := &runner{cfg: cfg, st: st, prog: prog, dec: decoder.NewRowDecoder(cfg.Decoder, cfg.Columns),
		tr: checkpoint.New[*decoder.Event](0, cfg.MaxInFlight, cfg.MaxInFlightBytes)}
	defer r.tr.Close()
	if err := r.open(ctx); err != nil {
		return err
	}
	err := scan(ctx, func(row Row) error { return r.row(ctx, row) })
	if err == nil {
		err = r.drain(ctx)
	}
	if r.sess != nil {
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), cfg.CloseTimeout)
		if cerr := r.sess.Close(cctx); cerr != nil && err == nil {
			err = fmt.Errorf("close the publishing session: %w", cerr)
		}
		cancel()
	}
	return err
}

type runner struct {
	cfg     Config
	st      Stream
	prog    *Progress
	dec     *decoder.RowDecoder
	tr      *checkpoint.Tracker[*decoder.Event]
	sess    Session
	k       int           // the next row's Jetbox-Tx-Index
	backoff time.Duration // the next wait after a failure
	fenced  time.Time     // when Config.Fence last passed
}

// fence checks Config.Fence: at once when force, else when FenceEvery has
// passed since the last check. Its error is permanent (see Config.Fence).
func (r *runner) fence(ctx context.Context, force bool) error {
	if r.cfg.Fence == nil || (!force && time.Since(r.fenced) < r.cfg.FenceEvery) {
		return nil
	}
	if err := r.cfg.Fence(ctx); err != nil {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		return fault.New(fmt.Errorf("the repair may no longer publish: %w", err),
			"another process may be repairing the slot now; this repair stops without publishing more (jetbox run --on-lost-slot=repair stands by, or run jetbox repair again once the other one is done)")
	}
	r.fenced = time.Now()
	return nil
}

// row publishes one row of the snapshot, unless the stream has it.
func (r *runner) row(ctx context.Context, row Row) error {
	ev, err := r.dec.Decode(row.Values, r.cfg.Position, row.Key, r.k)
	if err != nil {
		return err // an invalid row, without dead letters
	}
	id := ev.ID
	if ev.DeadLetter != nil {
		id = ev.DeadLetter.ID
	}
	switch r.cfg.Stored.holds(id, row.Inserted, r.cfg.Skew) {
	case held:
		r.prog.Skipped.Add(1)
		return nil
	case reused:
		cause := &decoder.InvalidEventError{ID: id, LSN: r.cfg.Position, TxIndex: r.k, Code: format.ReasonDuplicateID, Column: "id",
			Reason: "the stream holds a message with this id that was committed before the row was inserted (an id issued again, e.g. a sequence after a restore): JetStream would take the row for that message",
			Hint:   "give every outbox row a unique id (the default gen_random_uuid()); run with --on-invalid=dead-letter to send this row to the dead-letter subject"}
		if ie := r.deadLetterable(cause); ie == nil || ev.DeadLetter != nil {
			return cause
		}
		ev = r.cfg.Decoder.DeadLetter(&ev, cause)
	}
	r.k++
	e := &ev
	r.stamp(e)
	if err := r.recover(ctx); err != nil { // failures seen since the last row
		return err
	}
	if err := r.fence(ctx, false); err != nil {
		return err
	}
	ticket, err := r.add(ctx, e)
	if err != nil {
		return err
	}
	r.tr.Commit(pglogrepl.LSN(r.k)) // each row stands alone
	r.send(ticket, e)
	return nil
}

// stamp gives a repaired event its source and headers.
func (r *runner) stamp(ev *decoder.Event) {
	if ev.DeadLetter != nil {
		r.cfg.Log.Warn().Str("event_id", ev.DeadLetter.ID).Str("reason", ev.DeadLetter.Code).Str("dead_letter_subject", ev.Subject).
			Str("error", ev.DeadLetter.Error()).Msg("outbox row cannot be published: sending a dead letter instead")
	}
	ev.Origin = r.cfg.Origin
	ev.Headers = append(ev.Headers, decoder.Header{Key: HeaderRepaired, Value: "true"}, decoder.Header{Key: HeaderRepairSince, Value: r.cfg.SinceHeader})
	if r.cfg.Atomic {
		// Each repaired row stands alone: a consumer that buffers until a
		// transaction's end must not wait on the next one.
		ev.Headers = append(ev.Headers, decoder.Header{Key: HeaderTxLast, Value: "true"})
	}
}

// add tracks ev, waiting for room in the window; failures found meanwhile
// are recovered first.
func (r *runner) add(ctx context.Context, ev *decoder.Event) (checkpoint.Ticket, error) {
	size := len(ev.Payload) + 256
	for {
		ticket, err := r.tr.Add(ctx, size, ev)
		if !errors.Is(err, checkpoint.ErrFailures) {
			return ticket, err
		}
		if err := r.recover(ctx); err != nil {
			return 0, err
		}
	}
}

// send publishes one tracked event; every outcome resolves its ticket.
func (r *runner) send(ticket checkpoint.Ticket, ev *decoder.Event) {
	tr, prog := r.tr, r.prog
	err := r.sess.Publish(ev, func(err error) {
		if err != nil {
			tr.Fail(ticket, fmt.Errorf("publish id=%s: %w", ev.ID, err))
			return
		}
		tr.Done(ticket)
		prog.Published.Add(1)
	})
	if err != nil {
		tr.Fail(ticket, fmt.Errorf("publish id=%s: %w", ev.ID, err))
	}
}

// drain waits until every published row is stored, recovering failures.
func (r *runner) drain(ctx context.Context) error {
	for {
		if err := r.tr.WaitResolved(ctx); err != nil {
			return err
		}
		if n, _ := r.tr.Failures(); n == 0 {
			return nil
		}
		if err := r.recover(ctx); err != nil {
			return err
		}
	}
}

// recover publishes the failed rows again, in order, on a new session,
// until none is left failed; it returns at once when none is.
func (r *runner) recover(ctx context.Context) error {
	for attempt := 1; ; attempt++ {
		if n, _ := r.tr.Failures(); n == 0 {
			r.backoff = 0
			return nil
		}
		// Let the pass end: its acks resolve or are given up.
		if r.sess != nil {
			cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), r.cfg.CloseTimeout)
			_ = r.sess.Close(cctx)
			cancel()
			r.sess = nil
		}
		r.tr.FailPending(errAbandoned)
		// Any failed row may hold the reason to stop: their acks come in
		// any order, and the rows after a failure fail because of it.
		// Read once the session is closed, so a reason acked after the
		// failures it caused is not missed and no new session is opened
		// for it. (Rows resend gave up on while its session was open
		// keep errAbandoned: their later acks count for nothing, and a
		// reason among them shows one session later.)
		for _, err := range r.tr.FailedErrors() {
			if err := r.stopOn(err); err != nil {
				return err
			}
		}
		n, cause := r.tr.Failures()
		r.backoff = min(max(2*r.backoff, 200*time.Millisecond), r.cfg.MaxBackoff)
		r.cfg.Log.Warn().Err(cause).Int("failed", n).Int("attempt", attempt).Stringer("backoff", r.backoff).
			Msg("publish failed: republishing from the first unacked row, in order")
		if err := wait.Sleep(ctx, r.backoff); err != nil {
			return err
		}
		through, err := r.storedThrough(ctx)
		if err != nil {
			r.cfg.Log.Warn().Err(err).Msg("read how far the repair got")
			continue
		}
		if err := r.open(ctx); err != nil {
			return err
		}
		if err := r.resend(through); err != nil {
			return err
		}
		if err := r.tr.WaitResolved(ctx); err != nil {
			return err
		}
	}
}

// resend publishes the failed rows again, in window order; those at or
// before through (stored although their acks were lost) are done at once.
// A row the sink refused as invalid becomes its dead letter; a dead letter
// refused too, an invalid row without dead letters and a permanent error
// stop the repair (the window's order decides which failure counts: the
// acks that report them come in any order).
func (r *runner) resend(through int) error {
	for _, rt := range r.tr.Requeue() {
		ev := rt.Payload
		if ev.TxIndex <= through {
			r.tr.Done(rt.Ticket)
			r.prog.Published.Add(1)
			continue
		}
		if err := r.stopOn(rt.Err); err != nil {
			return err
		}
		var ie *decoder.InvalidEventError
		if errors.As(rt.Err, &ie) {
			if ev.DeadLetter != nil {
				return fmt.Errorf("the dead letter for a row could not be published either: %w", rt.Err)
			}
			// Found by the sink: a repeated id, too large for the server.
			*ev = r.cfg.Decoder.DeadLetter(ev, ie)
			r.stamp(ev)
		}
		r.send(rt.Ticket, ev)
		if n, _ := r.tr.Failures(); n > 0 {
			r.tr.FailPending(errAbandoned) // nothing after a failure can be stored
			return nil
		}
	}
	return nil
}

// storedThrough returns the highest index of this repair's rows the stream
// holds in order (-1: none known): with the order guard, its writer's last
// message, when it is one of this repair's rows.
func (r *runner) storedThrough(ctx context.Context) (int, error) {
	if !r.cfg.Ordered {
		return -1, nil
	}
	pos, ok, err := r.st.Last(ctx)
	if err != nil || !ok || pos.Origin != r.cfg.Origin || pos.CommitLSN != r.cfg.Position {
		return -1, err
	}
	if pos.TxIndex >= 0 {
		r.cfg.Log.Info().Int("stored_through", pos.TxIndex).Msg("repair: the stream holds the rows up to this index (their acks were lost): going on after them")
	}
	return pos.TxIndex, nil
}

// open opens a publishing session, retrying transient failures.
func (r *runner) open(ctx context.Context) error {
	for {
		if err := r.fence(ctx, true); err != nil {
			return err
		}
		sess, err := r.st.Open(ctx)
		if err == nil {
			r.sess = sess
			return nil
		}
		if fault.Is(err) || ctx.Err() != nil {
			return err
		}
		r.backoff = min(max(2*r.backoff, 200*time.Millisecond), r.cfg.MaxBackoff)
		r.cfg.Log.Warn().Err(err).Stringer("backoff", r.backoff).Msg("open publishing session")
		if err := wait.Sleep(ctx, r.backoff); err != nil {
			return err
		}
	}
}

// stopOn returns the error a failure stops the repair with: an invalid row
// it may not dead-letter, or a permanent error; nil to retry.
func (r *runner) stopOn(cause error) error {
	var ie *decoder.InvalidEventError
	if errors.As(cause, &ie) {
		if r.deadLetterable(cause) == nil {
			return cause
		}
		return nil
	}
	if fault.Is(cause) {
		return cause
	}
	return nil
}

// deadLetterable returns the invalid-row error in err when dead-lettering
// is on and a dead letter may replace the row.
func (r *runner) deadLetterable(err error) *decoder.InvalidEventError {
	var ie *decoder.InvalidEventError
	if r.cfg.Decoder.DeadLetterSubject != "" && errors.As(err, &ie) && ie.DeadLetterable() {
		return ie
	}
	return nil
}
