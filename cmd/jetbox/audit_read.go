package main

// jetbox audit's readers: the stream (headers only) and what it holds, and
// the table's rows page by page.

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/jetbox-dev/jetbox/internal/audit"
	"github.com/jetbox-dev/jetbox/replication"
	"github.com/jetbox-dev/jetbox/sink/format"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// openStream looks up the stream and what it holds now; a stream that
// does not exist is undecided.
func openStream(ctx context.Context, js jetstream.JetStream, name string) (jetstream.Stream, streamRange, error) {
	sctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	st, err := js.Stream(sctx, name)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		return nil, streamRange{}, &undecided{fmt.Sprintf("stream %q does not exist", name), "check --stream (jetbox run creates it)"}
	}
	if err != nil {
		return nil, streamRange{}, fmt.Errorf("look up stream %q: %w", name, err)
	}
	info := st.CachedInfo()
	return st, streamRange{first: info.State.FirstSeq, last: info.State.LastSeq, firstTime: info.State.FirstTime, msgs: info.State.Msgs,
		deleted: uint64(info.State.NumDeleted), cfg: info.Config}, nil
}

// removedDuring refuses an audit during which the stream removed messages
// of the range (max_age expiring them near its start, a purge): a row
// whose message went before the audit read it counts as missing.
func removedDuring(ctx context.Context, st jetstream.Stream, sr streamRange, since time.Time, margin time.Duration) error {
	info, err := st.Info(ctx)
	if err != nil {
		return fmt.Errorf("look up the stream after the audit: %w", err)
	}
	return removed(sr, info.State, since, margin)
}

// removed is removedDuring on the stream's state at the end.
func removed(sr streamRange, end jetstream.StreamState, since time.Time, margin time.Duration) error {
	if end.FirstSeq <= sr.first || (end.Msgs > 0 && !end.FirstTime.After(since.Add(-margin))) {
		return nil // nothing removed, or only messages before the range
	}
	return &undecided{fmt.Sprintf("the stream removed its messages up to seq %d while the audit ran (it started at seq %d; max_age, max_msgs or a purge), and some were of the range from %s: their rows would count as missing",
		end.FirstSeq-1, sr.first, since.Add(-margin).Format(time.RFC3339Nano)),
		"audit a range that starts well after the stream's first message (the limit removes the oldest), or raise the stream's max_age"}
}

// judgeable refuses a range whose start the stream no longer holds: its
// first messages were removed (limits, a purge) after the range's start,
// so rows of the range may have had messages that are gone.
func judgeable(sr streamRange, since time.Time, margin time.Duration) error {
	if sr.cfg.Retention != jetstream.LimitsPolicy {
		return &undecided{fmt.Sprintf("the stream has %s retention: it removes messages once consumed, so it is no record of what was published and the rows of removed messages would count as missing", sr.cfg.Retention),
			"audit a stream with limits retention (jetbox run creates it so); with interest or work-queue retention count the consumers' acknowledgements instead"}
	}
	if sr.first <= 1 {
		return nil // nothing removed from the stream's start
	}
	removed := sr.first - 1
	if sr.msgs > 0 && !sr.firstTime.After(since.Add(-margin)) {
		return nil // the stream starts before the range (and its margin)
	}
	var limits []string
	if sr.cfg.MaxAge > 0 {
		limits = append(limits, "max_age "+sr.cfg.MaxAge.String())
	}
	if sr.cfg.MaxMsgs > 0 {
		limits = append(limits, fmt.Sprintf("max_msgs %d", sr.cfg.MaxMsgs))
	}
	if sr.cfg.MaxBytes > 0 {
		limits = append(limits, fmt.Sprintf("max_bytes %d", sr.cfg.MaxBytes))
	}
	if sr.cfg.MaxMsgsPerSubject > 0 {
		limits = append(limits, fmt.Sprintf("max_msgs_per_subject %d", sr.cfg.MaxMsgsPerSubject))
	}
	why := "the stream has no limit, so a purge or a delete removed them"
	if len(limits) > 0 {
		why = "the stream's " + strings.Join(limits, ", ") + " (or a purge) removed them"
	}
	start := "holds no message"
	fix := "audit a range that the stream still holds"
	if sr.msgs > 0 {
		start = fmt.Sprintf("starts at seq %d, stored %s", sr.first, sr.firstTime.UTC().Format(time.RFC3339Nano))
		fix = fmt.Sprintf("audit from after the stream's start: --since %s (its first message's stored time plus --margin)", sr.firstTime.Add(margin).UTC().Format(time.RFC3339))
	}
	return &undecided{fmt.Sprintf("the range starts at %s but the stream %s: the messages before seq %d are gone (%s), and the rows they carried would count as missing",
		since.Format(time.RFC3339Nano), start, removed+1, why), fix}
}

// rowFunc reads the range's rows in keyset pages.
func (a *auditor) rowFunc(tbl *replication.AuditTable, since time.Time) audit.RowFunc {
	type result struct {
		rows []replication.AuditRow
		err  error
	}
	var page []replication.AuditRow
	var next chan result // the page after page, being read
	i, first, done := 0, true, false
	// fetch reads the page after (key, id) in the background: the next
	// page is read while the stream is compared with this one.
	fetch := func(ctx context.Context, first bool, key time.Time, id string) chan result {
		ch := make(chan result, 1)
		go func() {
			p, err := tbl.Page(ctx, since, a.s.until, first, key, id, a.s.pageSize)
			ch <- result{p, err}
		}()
		return ch
	}
	return func(ctx context.Context) (audit.Row, bool, error) {
		if i == len(page) {
			if done {
				return audit.Row{}, false, nil
			}
			if next == nil {
				next = fetch(ctx, true, time.Time{}, "")
			}
			var r result
			select {
			case r = <-next:
			case <-ctx.Done():
				return audit.Row{}, false, ctx.Err()
			}
			if r.err != nil {
				return audit.Row{}, false, r.err
			}
			page, i, first = r.rows, 0, false
			done = len(page) < a.s.pageSize
			if len(page) == 0 {
				return audit.Row{}, false, nil
			}
			if !done {
				next = fetch(ctx, first, page[len(page)-1].Key, page[len(page)-1].ID)
			}
		}
		r := page[i]
		i++
		a.rows.Add(1)
		return audit.Row{ID: r.ID, Key: r.Key}, true, nil
	}
}

// readStream gives the auditor the stream's messages (headers only) from
// the first stored at since minus the margin, up to the first whose commit
// time is past the range's end plus the margin, or the stream's last
// message at the audit's start (or the last there is, when the last ones
// were deleted).
func (a *auditor) readStream(ctx context.Context, st jetstream.Stream, sr streamRange, since time.Time, aud *audit.Auditor) error {
	if sr.msgs == 0 {
		return nil
	}
	start := since.Add(-a.s.margin)
	cons, err := st.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{HeadersOnly: true, DeliverPolicy: jetstream.DeliverByStartTimePolicy, OptStartTime: &start})
	if err != nil {
		return fmt.Errorf("read stream %q: %w", a.s.cfg.Sink.Stream, err)
	}
	if ci := cons.CachedInfo(); ci != nil && ci.NumPending == 0 {
		return nil // no message stored at or after the start
	}
	r := newBatchReader(sr.last)
	cc, err := cons.Consume(r.handle, jetstream.PullMaxMessages(16384), jetstream.ConsumeErrHandler(r.consumeError))
	if err != nil {
		return fmt.Errorf("read stream %q: %w", a.s.cfg.Sink.Stream, err)
	}
	defer cc.Stop()
	defer close(r.done) // before Stop: a handler blocked on a send returns
	end := a.s.until.Add(a.s.margin)
	passed := false // the stream passed the range: reading on for late copies
	for {
		var batch []streamMsg
		select {
		case batch = <-r.batches:
		case err := <-r.errs:
			return fmt.Errorf("read stream %q (%d messages read): %w", a.s.cfg.Sink.Stream, a.msgs.Load(), err)
		case <-ctx.Done():
			return fmt.Errorf("read stream %q (%d messages read): %w", a.s.cfg.Sink.Stream, a.msgs.Load(), ctx.Err())
		}
		for _, m := range batch {
			a.msgs.Add(1)
			if !passed && m.msg.Time.After(end) && !m.msg.Repaired && a.ours(m.origin, m.hasOrigin) {
				// This writer publishes in commit order: none of its later
				// messages is of the range. Rows still unmatched may have
				// been stored later (jetbox repair, another publisher).
				if err := aud.EndRows(ctx); err != nil {
					return err
				}
				if aud.Missing() == 0 {
					return nil
				}
				passed = true
			}
			if err := aud.Msg(ctx, m.msg); err != nil {
				return err
			}
			if m.last {
				return nil
			}
		}
	}
}

// streamMsg is one stored message as the audit compares it.
type streamMsg struct {
	msg       audit.Msg
	origin    format.Origin
	hasOrigin bool // origin parsed: a message jetbox wrote
	last      bool // the stream's last message at the audit's start, or the last stored now
}

// batchReader turns the ordered consumer's callbacks into batches for the
// audit's goroutine: the headers are parsed and mapped in the consumer's
// delivery goroutine while the audit compares the batch before, and a
// batch costs one channel hand-off rather than one per message.
type batchReader struct {
	lastSeq uint64 // the stream's last sequence at the audit's start
	batch   []streamMsg
	batches chan []streamMsg
	broken  bool // a message could not be read: the read ends (errs)
	errs    chan error
	done    chan struct{} // closed when the audit stops reading
}

// batchSize: messages handed over at once; a batch is handed over early
// when the consumer has delivered all the stream holds.
const batchSize = 512

func newBatchReader(lastSeq uint64) *batchReader {
	return &batchReader{lastSeq: lastSeq, batch: make([]streamMsg, 0, batchSize), batches: make(chan []streamMsg, 4), errs: make(chan error, 1), done: make(chan struct{})}
}

// handle is the consumer's message handler, called in stream order.
func (r *batchReader) handle(m jetstream.Msg) {
	if r.broken {
		return // no message after one that could not be read
	}
	md, err := m.Metadata()
	if err != nil {
		r.broken = true
		r.fail(fmt.Errorf("read a message's metadata: %w", err))
		return
	}
	msg, o, ok := auditMsg(m.Headers(), md.Sequence.Stream, md.Timestamp)
	last := md.Sequence.Stream >= r.lastSeq || md.NumPending == 0
	r.batch = append(r.batch, streamMsg{msg: msg, origin: o, hasOrigin: ok, last: last})
	if len(r.batch) < batchSize && !last {
		return
	}
	select {
	case r.batches <- r.batch:
		r.batch = make([]streamMsg, 0, batchSize)
	case <-r.done:
	}
}

// consumeError ends the read on any error but those the ordered consumer
// recovers from by recreating itself from the last message delivered (a
// missed heartbeat, a deleted consumer, no responders, a leader change):
// an error it stops on (a closed connection, a bad request) would leave
// the audit waiting for messages that never come.
func (r *batchReader) consumeError(_ jetstream.ConsumeContext, err error) {
	switch {
	case errors.Is(err, jetstream.ErrNoHeartbeat), errors.Is(err, jetstream.ErrConsumerDeleted),
		errors.Is(err, nats.ErrNoResponders), errors.Is(err, jetstream.ErrConsumerLeadershipChanged):
	default:
		r.fail(err)
	}
}

func (r *batchReader) fail(err error) {
	select {
	case r.errs <- err:
	default:
	}
}

// auditMsg maps a message's headers to what the audit compares, and its
// origin (ok false for a message jetbox did not write).
func auditMsg(h nats.Header, seq uint64, stored time.Time) (m audit.Msg, o format.Origin, ok bool) {
	get := h.Get
	m = audit.Msg{Seq: seq, ID: get(jetstream.MsgIDHeader), RowID: get(format.HeaderRowID), Stored: stored.UTC(), Time: stored.UTC(),
		Repaired: get(format.HeaderRepaired) == "true"}
	if t, err := time.Parse(time.RFC3339Nano, get(format.HeaderCommitTime)); err == nil && t.Year() > 1 {
		m.Time = t.UTC()
	}
	lsn, lsnOK := format.ParseLSN(get(format.HeaderCommitLSN))
	idx, err2 := strconv.Atoi(get(format.HeaderTxIndex))
	if src := get(format.HeaderSource); src != "" && lsnOK && err2 == nil {
		// Positions compare within one history: the origin with its
		// timeline (a failover or a restore starts another).
		m.Writer = src
		m.LSN, m.Index = uint64(lsn), idx
		o, ok = format.ParseOrigin(src)
	}
	return m, o, ok
}
