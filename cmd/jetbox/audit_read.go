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
	it, err := cons.Messages(jetstream.PullMaxMessages(16384))
	if err != nil {
		return fmt.Errorf("read stream %q: %w", a.s.cfg.Sink.Stream, err)
	}
	end := a.s.until.Add(a.s.margin)
	// decides: the message that may end the audit (below).
	decides := func(m streamMsg) bool {
		return m.msg.Time.After(end) && !m.msg.Repaired && a.ours(m.origin, m.hasOrigin)
	}
	rctx, cancel := context.WithCancel(ctx)
	batches := make(chan streamBatch, 4)
	read := make(chan struct{})
	go func() {
		defer close(read)
		readBatches(rctx, it, sr.last, decides, batches)
	}()
	defer func() { cancel(); it.Stop(); <-read }()
	passed := false // the stream passed the range: reading on for late copies
	for {
		var b streamBatch
		select {
		case b = <-batches:
		case <-ctx.Done():
			return fmt.Errorf("read stream %q (%d messages read): %w", a.s.cfg.Sink.Stream, a.msgs.Load(), ctx.Err())
		}
		for _, m := range b.msgs {
			a.msgs.Add(1)
			if !passed && decides(m) {
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
		if b.err != nil {
			return fmt.Errorf("read stream %q (%d messages read): %w", a.s.cfg.Sink.Stream, a.msgs.Load(), b.err)
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

// streamBatch is messages in stream order, then err if the read ended on one.
type streamBatch struct {
	msgs []streamMsg
	err  error
}

// batchSize: messages handed to the comparison at once.
const batchSize = 512

// readBatches reads it (the ordered consumer's iterator, which recreates
// the consumer after a missed heartbeat, a reconnect or a gap, from the
// last message it returned) in one goroutine, maps each message's headers
// and hands them on in batches, so that the comparison runs beside the
// reading and a batch costs one hand-off rather than one per message. A
// batch is handed on early at the first message that decides (the one
// that may end the audit, which must not wait for messages that may never
// come) and at the last; the read ends there, on an error (sent after the
// messages before it) or when ctx ends.
func readBatches(ctx context.Context, it jetstream.MessagesContext, lastSeq uint64, decides func(streamMsg) bool, out chan<- streamBatch) {
	batch := make([]streamMsg, 0, batchSize)
	send := func(b streamBatch) bool {
		select {
		case out <- b:
			return true
		case <-ctx.Done():
			return false
		}
	}
	decided := false
	var origins originCache
	for {
		m, err := it.Next(jetstream.NextContext(ctx))
		if err != nil {
			send(streamBatch{batch, err})
			return
		}
		md, err := m.Metadata()
		if err != nil {
			send(streamBatch{batch, fmt.Errorf("read a message's metadata: %w", err)})
			return
		}
		msg, o, ok := auditMsg(m.Headers(), md.Sequence.Stream, md.Timestamp, &origins)
		last := md.Sequence.Stream >= lastSeq || md.NumPending == 0
		sm := streamMsg{msg: msg, origin: o, hasOrigin: ok, last: last}
		batch = append(batch, sm)
		first := !decided && decides(sm)
		decided = decided || first
		if last {
			send(streamBatch{msgs: batch})
			return
		}
		if len(batch) == batchSize || first {
			if !send(streamBatch{msgs: batch}) {
				return
			}
			batch = make([]streamMsg, 0, batchSize)
		}
	}
}

// originCache parses Jetbox-Source values, keeping the last one parsed: a
// writer's messages all carry the same value, so most parse nothing, and
// they share one string.
type originCache struct {
	src string
	o   format.Origin
	ok  bool
}

func (c *originCache) parse(src string) (string, format.Origin, bool) {
	if src != c.src {
		c.src = src
		c.o, c.ok = format.ParseOrigin(src)
	}
	return c.src, c.o, c.ok
}

// auditMsg maps a message's headers to what the audit compares, and its
// origin (ok false for a message jetbox did not write).
func auditMsg(h nats.Header, seq uint64, stored time.Time, origins *originCache) (m audit.Msg, o format.Origin, ok bool) {
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
		m.Writer, o, ok = origins.parse(src)
		m.LSN, m.Index = uint64(lsn), idx
	}
	return m, o, ok
}
