package sink

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jetbox-dev/jetbox/sink/format"

	"github.com/jackc/pglogrepl"
	"github.com/jetbox-dev/jetbox/decoder"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// What both publishing sessions share: where a session resumes (resume and
// its cursor), the counters (record), and the invalid-row errors they build.
// Session (pipeline.go) and AtomicSession (atomic.go) sit on top.

// Stats are cumulative publishing counters.
type Stats struct {
	Published  uint64 // stored by JetStream (new messages)
	Duplicates uint64 // acked as Duplicate: already stored, counted as success
	Errors     uint64 // failed or unknown outcome; the event is republished
}

// Stats returns the counters so far.
func (p *Publisher) Stats() Stats {
	return Stats{Published: p.stats.published.Load(), Duplicates: p.stats.duplicates.Load(), Errors: p.stats.errors.Load()}
}

// outcome is what became of published events, for record.
type outcome int

const (
	outStored    outcome = iota // stored by JetStream as new messages
	outDuplicate                // already in the stream: acked as Duplicate, or skipped by position
	outFailed                   // failed or unknown outcome: the events are republished
)

// record counts n events with outcome o, in Stats and in the metrics.
func (p *Publisher) record(o outcome, n int) {
	m := p.cfg.Metrics
	switch o {
	case outStored:
		p.stats.published.Add(uint64(n))
		m.Published.Add(float64(n))
		m.Acked()
	case outDuplicate:
		p.stats.duplicates.Add(uint64(n))
		m.Duplicates.Add(float64(n))
		m.Acked()
	case outFailed:
		p.stats.errors.Add(uint64(n))
		m.PublishErrors.Add(float64(n))
	}
}

const duplicateHint = "give every outbox row a unique id (the default gen_random_uuid()); run with --on-invalid=dead-letter to send this row to the dead-letter subject"

// duplicateID is the invalid-row error of the row id at pos, whose id another
// message uses; reason says which and what JetStream would do.
func duplicateID(id string, pos format.Position, reason string) *decoder.InvalidEventError {
	return &decoder.InvalidEventError{ID: id, LSN: pglogrepl.LSN(pos.CommitLSN), TxIndex: pos.TxIndex,
		Code: format.ReasonDuplicateID, Column: "id", Reason: reason, Hint: duplicateHint}
}

// tooLarge is the invalid-row error of a message the server or stream refuses for its size.
func tooLarge(id string, pos format.Position, what string) *decoder.InvalidEventError {
	return &decoder.InvalidEventError{ID: id, LSN: pglogrepl.LSN(pos.CommitLSN), TxIndex: pos.TxIndex, Code: format.ReasonTooLarge, Column: "payload", Reason: what,
		Hint: "raise max_payload on the NATS server (and the stream's max_msg_size), or keep outbox payloads smaller (e.g. a CHECK on octet_length(payload)); or run with --on-invalid=dead-letter"}
}

// ErrForeignMessage means the stream holds a message jetbox did not write,
// which exactly-once mode cannot order against.
var ErrForeignMessage = errors.New("the stream holds a message jetbox did not write")

// cursor is where a session resumes: the stream and its last message as
// resume found them when the session opened. Which mode-specific fields are
// set is up to the mode's resume: resumeExactlyOnce sets skip, watermark
// and chain; resumeDedup only watermark.
type cursor struct {
	stream jetstream.Stream
	seq    uint64          // the stream's last sequence; 0: the stream is empty
	id     string          // the last message's Nats-Msg-Id ("" if it was not read)
	pos    format.Position // its position (zero if it has none or was not read)
	// abandoned: after an accepted lost history (ForgetHistory), what the
	// stream holds of it at the positions the slot replays: position → id.
	abandoned map[format.Position]string

	// watermark (both modes): the stream holds this source's events in
	// order up to pos, so a Duplicate PubAck for an event at or before pos
	// is a replay; one after it is checked against the original.
	watermark bool
	// skip (exactly-once): the last message is this source's, so an event
	// at or before pos is a replay the stream holds, skipped by position.
	skip bool
	// chain (exactly-once): id is the message the first publish names in
	// Nats-Expected-Last-Msg-Id (on an R1 stream).
	chain bool
}

// replay reports whether the event at pos with id is one the stream
// already holds: at or before its last message (exactly-once mode), or the
// same id at the same position of an abandoned history (the part the
// server still shares with it).
func (c cursor) replay(pos format.Position, id string) bool {
	if c.abandoned != nil && id != "" && c.abandoned[pos] == id {
		return true
	}
	return c.skip && !c.pos.Less(pos)
}

// skipReplay skips the event at pos with id if it is a replay (see
// cursor.replay): it counts as a duplicate and its done is called with nil
// at once.
func (p *Publisher) skipReplay(c cursor, pos format.Position, id string, done func(error)) bool {
	if !c.replay(pos, id) {
		return false
	}
	p.record(outDuplicate, 1)
	done(nil)
	return true
}

// SkipHeld skips the event at (lsn, txIndex) when the stream is known to
// hold it by position alone, counting it as a replay the way Publish skips
// one: a row that cannot be published now (--on-invalid=stop) but whose
// dead letter an earlier run stored, before the slot confirmed it, is a
// replay to skip, not a row to stop on. Only exactly-once mode knows: its
// stream holds this source's events without a gap up to the last one. In
// dedup mode a position at or before the tip or the watermark does not
// prove the row is there (a gap a run without the order guard left, a
// watermark of an abandoned history): such a row stops jetbox.
func (s *Session) SkipHeld(lsn pglogrepl.LSN, txIndex int) bool {
	if !s.cur.replay(format.Position{CommitLSN: uint64(lsn), TxIndex: txIndex}, "") {
		return false
	}
	s.p.record(outDuplicate, 1)
	return true
}

// SkipHeld is Session.SkipHeld for an atomic session: a replay of what
// the stream held at open.
func (s *AtomicSession) SkipHeld(lsn pglogrepl.LSN, txIndex int) bool {
	if !s.cur.replay(format.Position{CommitLSN: uint64(lsn), TxIndex: txIndex}, "") {
		return false
	}
	s.p.record(outDuplicate, 1)
	return true
}

// eventPos is ev's position: where its message goes in the stream.
func eventPos(ev *decoder.Event) format.Position {
	return format.Position{CommitLSN: uint64(ev.CommitLSN), TxIndex: ev.TxIndex}
}

// covers reports whether a Duplicate PubAck for the event at pos is a replay
// without looking at the original.
func (c cursor) covers(pos format.Position) bool { return c.watermark && !c.pos.Less(pos) }

// resume checks the stream still exists and captures jetbox's subjects (so
// a stream deleted or changed while jetbox runs stops it with a clear error
// rather than retrying forever), then reads the stream's last message and
// leaves the rest to the delivery mode: resumeExactlyOnce (where to resume)
// or resumeDedup (the watermark for duplicate checks).
//
// source identifies this writer's WAL history: exactly-once mode refuses to
// resume after a message from another one, unless repair (a jetbox repair
// session, see OpenRepair), which resumes after nothing.
func (p *Publisher) resume(ctx context.Context, source string, repair bool) (cursor, error) {
	outer := ctx
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	st, err := p.liveStream(ctx)
	if err != nil {
		return cursor{}, err
	}
	c := cursor{stream: st, seq: st.CachedInfo().State.LastSeq}
	if c.seq == 0 {
		return c, nil
	}
	if c.abandoned, err = p.abandonedIndex(outer); err != nil {
		return cursor{}, err
	}
	m, err := st.GetMsg(ctx, c.seq)
	if !p.cfg.Delivery.ExactlyOnce() {
		return p.resumeDedup(c, m, err, source), nil
	}
	return p.resumeExactlyOnce(ctx, c, m, err, source, repair)
}

// liveStream looks the stream up and checks it still captures jetbox's
// subjects (and the dead letters).
func (p *Publisher) liveStream(ctx context.Context) (jetstream.Stream, error) {
	name := p.cfg.Stream
	st, err := p.js.Stream(ctx, name)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		return nil, &PermanentError{Err: fmt.Errorf("stream %q does not exist (deleted while jetbox ran?)", name),
			Hint: "nothing past the last stored event was confirmed to Postgres: restart jetbox, which creates the stream again and resumes from the slot (or create it yourself first)"}
	}
	if err != nil {
		return nil, fmt.Errorf("look up stream %q: %w", name, err)
	}
	info := st.CachedInfo()
	for _, want := range []string{p.cfg.SubjectPrefix + ".>", p.cfg.DeadLetterSubject + ".>"} {
		if want != ".>" && !Captures(info.Config.Subjects, want) {
			return nil, &PermanentError{Err: fmt.Errorf("stream %q has subjects %q, which no longer capture %q (changed while jetbox ran?)", name, info.Config.Subjects, want),
				Hint: fmt.Sprintf("add %q back to the stream's subjects (nats stream edit %s), then restart jetbox; nothing past the last stored event was confirmed", want, name)}
		}
	}
	return st, nil
}

// sameSource reports whether the stream's last message m (at c.seq) is
// this writer's (source): the same system, database and slot, and not of
// a lost history an operator accepted (at or before forgotThrough, see
// ForgetPositionsThrough). Replication checked that the server's timeline
// continues the stream's (see sameWriter).
func sameSource(c cursor, m *jetstream.RawStreamMsg, source string, forgotThrough uint64) bool {
	return format.SameWriter(m.Header.Get(format.HeaderSource), source) && c.seq > forgotThrough
}

// resumeDedup completes c in dedup mode from the stream's last message m
// (or getErr, the failure to read it): with the order guard, the watermark
// covers up to m when m is this source's. Nothing is skipped by position.
func (p *Publisher) resumeDedup(c cursor, m *jetstream.RawStreamMsg, getErr error, source string) cursor {
	if getErr != nil {
		return c // no watermark: every Duplicate PubAck is checked
	}
	pos, ok := format.ParsePosition(m.Header)
	c.id, c.pos = m.Header.Get(jetstream.MsgIDHeader), pos
	// Without the order guard, rows after a refused one may be stored
	// before it is retried: no watermark, check every Duplicate.
	c.watermark = ok && sameSource(c, m, source, p.forgetThrough.Load()) && p.cfg.Delivery.Guarded()
	return c
}

// resumeExactlyOnce completes c in exactly-once mode from the stream's
// last message m (or getErr, the failure to read it): the session resumes
// after m, skipping replays by position, once m is known to be this
// source's and the messages since this process's last ack are jetbox's.
func (p *Publisher) resumeExactlyOnce(ctx context.Context, c cursor, m *jetstream.RawStreamMsg, getErr error, source string, repair bool) (cursor, error) {
	if errors.Is(getErr, jetstream.ErrMsgNotFound) {
		return cursor{}, &PermanentError{Err: fmt.Errorf("exactly-once: the stream's last message (seq %d) is gone", c.seq),
			Hint: "exactly-once mode resumes from the stream's last message: use a retention that keeps it (limits, no max-age shorter than an outage), or --delivery=dedup"}
	}
	if getErr != nil {
		return cursor{}, fmt.Errorf("exactly-once: read the stream's last message (seq %d): %w", c.seq, getErr)
	}
	pos, ok := format.ParsePosition(m.Header)
	c.id, c.pos = m.Header.Get(jetstream.MsgIDHeader), pos
	if !ok {
		return cursor{}, &PermanentError{Err: fmt.Errorf("exactly-once: %w (seq %d, subject %s)", ErrForeignMessage, c.seq, m.Subject),
			Hint: "exactly-once mode needs jetbox to be the stream's only writer: stop the other publisher (or use --delivery=dedup), then restart jetbox"}
	}
	if repair {
		// jetbox repair starts the new slot's history: nothing of it is in
		// the stream yet, so nothing is skipped by position (after a rewind
		// or a lost tail the stream's positions may even sort after it).
		c.chain = true
		p.log.Info().Uint64("seq", c.seq).Str("last_source", m.Header.Get(format.HeaderSource)).Msg("exactly-once repair: publishing the rows the stream misses, skipping nothing by position")
		return c, nil
	}
	if c.seq <= p.forgetThrough.Load() {
		// An accepted lost history: its positions are not comparable.
		p.log.Warn().Uint64("seq", c.seq).Msg("exactly-once: the stream's last message belongs to an abandoned WAL history: skipping nothing by position")
		return c, nil
	}
	if !sameSource(c, m, source, p.forgetThrough.Load()) {
		return cursor{}, &PermanentError{Err: fmt.Errorf("exactly-once: the stream's last message (seq %d) comes from %q, this jetbox reads %q", c.seq, m.Header.Get(format.HeaderSource), source),
			Hint: "positions from another database, slot or cluster are not comparable: give each jetbox its own stream, or use --delivery=dedup"}
	}
	if err := p.checkSinceLastAck(ctx, c.stream, source, c.seq); err != nil {
		return cursor{}, err
	}
	// Every message up to the last is now known to be jetbox's, in order:
	// the next check starts after it. Otherwise stores whose acks a cut
	// lost, session after session, would add up to more than one session
	// has in flight and read as a foreign writer.
	p.raiseAcked(c.seq)
	c.skip, c.watermark, c.chain = true, true, true
	p.log.Info().Uint64("seq", c.seq).Str("lsn", pglogrepl.LSN(pos.CommitLSN).String()).Int("tx_index", pos.TxIndex).
		Msg("exactly-once: resuming after the stream's last message")
	return c, nil
}

// checkSinceLastAck makes sure the messages stored after the last one this
// process saw acked in order (no failure before it in its session) are
// jetbox's, from source: a foreign message that slipped in after a refused
// publish would otherwise let a later one of ours match its expected
// sequence, and resuming after that one would skip the refused event.
//
// Only a window of ours can follow that ack (the pipeline stops at a
// failure), so only the window after it is read. More messages than that
// are another instance's on the same slot: the active one while this one
// stood by (replication opens a session only once it holds the slot). Each
// of them is an earlier part of the history resume found at the tip (the
// same source), stored behind its own checks, and was never in this
// process's pipeline: they neither tell of a foreign writer nor need this
// check.
func (p *Publisher) checkSinceLastAck(ctx context.Context, st jetstream.Stream, source string, lastSeq uint64) error {
	acked := p.ackedSeq.Load()
	if acked == 0 || lastSeq <= acked {
		return nil
	}
	// end: the first sequence not checked here (lastSeq, the tip, resume
	// checked), or the first past the window.
	end := lastSeq
	if window := uint64(p.cfg.MaxPending) + 16; lastSeq-acked > window {
		end = acked + window + 1
		p.log.Info().Uint64("seq", acked).Uint64("stored_since", lastSeq-acked).
			Msg("exactly-once: more messages after this process's last acked one than it had in flight: another instance streamed from the slot meanwhile; checking the window after it")
	}
	check := func(seq uint64, subject string, h nats.Header) error {
		if _, ok := format.ParsePosition(h); !ok || !format.SameWriter(h.Get(format.HeaderSource), source) {
			return &PermanentError{Err: fmt.Errorf("exactly-once: %w (seq %d, subject %s, after jetbox's seq %d)", ErrForeignMessage, seq, subject, acked),
				Hint: "exactly-once mode needs jetbox to be the stream's only writer: stop the other publisher (or use --delivery=dedup), then restart jetbox"}
		}
		return nil
	}
	if end-acked < 2 {
		return nil
	}
	// One headers-only ordered consumer reads them in a few round trips (a
	// read per message costs one each: ~1,000 at 10 ms is over the limit).
	cons, err := st.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{
		DeliverPolicy: jetstream.DeliverByStartSequencePolicy, OptStartSeq: acked + 1, HeadersOnly: true,
		InactiveThreshold: 10 * time.Second})
	if err != nil {
		// E.g. a WorkQueue stream refusing a second consumer: one by one.
		p.log.Warn().Err(err).Msg("exactly-once: cannot read the stream with a consumer; reading messages one by one")
		for seq := acked + 1; seq < end; seq++ {
			m, err := st.GetMsg(ctx, seq)
			if errors.Is(err, jetstream.ErrMsgNotFound) {
				continue
			}
			if err != nil {
				return fmt.Errorf("exactly-once: read message seq %d: %w", seq, err)
			}
			if err := check(seq, m.Subject, m.Header); err != nil {
				return err
			}
		}
		return nil
	}
	defer func() { // its interest would hold messages of an Interest stream
		if info := cons.CachedInfo(); info != nil {
			dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Second)
			defer cancel()
			_ = st.DeleteConsumer(dctx, info.Name)
		}
	}()
	for seq := acked; seq < end-1; {
		batch, err := cons.FetchNoWait(int(end - 1 - seq))
		if err != nil {
			return fmt.Errorf("exactly-once: read the messages after seq %d: %w", seq, err)
		}
		n := 0
		for m := range batch.Messages() {
			n++
			md, err := m.Metadata()
			if err != nil {
				return fmt.Errorf("exactly-once: read the messages after seq %d: %w", seq, err)
			}
			if seq = md.Sequence.Stream; seq >= end {
				break
			}
			if err := check(seq, m.Subject(), m.Headers()); err != nil {
				return err
			}
		}
		if err := batch.Error(); err != nil {
			return fmt.Errorf("exactly-once: read the messages after seq %d: %w", seq, err)
		}
		if n == 0 {
			break // the rest was removed meanwhile
		}
	}
	return nil
}

// raiseAcked moves ackedSeq up to seq (never down).
func (p *Publisher) raiseAcked(seq uint64) {
	for {
		cur := p.ackedSeq.Load()
		if seq <= cur || p.ackedSeq.CompareAndSwap(cur, seq) {
			return
		}
	}
}
