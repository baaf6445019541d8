package sink

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jetbox-dev/jetbox/sink/format"

	"github.com/jackc/pglogrepl"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// Tip is the last message jetbox stored on its subjects: where the stream's
// history of a database ends.
type Tip struct {
	Seq        uint64
	Origin     string // Jetbox-Source
	CommitLSN  pglogrepl.LSN
	TxIndex    int    // Jetbox-Tx-Index
	ID         string // Nats-Msg-Id
	RowID      string // Jetbox-Row-Id of a dead letter
	CommitTime string // Jetbox-Commit-Time, as stored
	Scheme     string // Jetbox-Index-Scheme: "" when absent (--source=table)
	Routing    string // Jetbox-Routing: "" when absent (the default routing, not atomic)
	TxLast     bool   // Jetbox-Tx-Last: true (the last message of an atomic transaction)
	// AggregateType, AggregateID and EventType are the message's
	// Jetbox-Aggregate-* and Jetbox-Event-Type: what its subject was
	// rendered from.
	AggregateType, AggregateID, EventType string
	Stored                                time.Time // when the server stored it
	// RepairSince is Jetbox-Repair-Since: set on the rows and markers of
	// a jetbox repair, the start of the range it repairs.
	RepairSince string
	Subject     string
}

// Tip returns the last message on <prefix>.> that writer (a
// format.Origin's Writer: this system, database and slot) stored; ok is
// false when the stream does not exist or holds none. In a stream shared
// with other writers (dedup mode: other databases, or other publishers on
// the prefix) the last message on jetbox's subjects may be another's: the
// stream's messages on them are then read, headers only, back to this
// writer's last one. The publisher remembers how far it read, so a later
// call reads only what was stored since.
func (p *Publisher) Tip(ctx context.Context, writer string) (Tip, bool, error) {
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	st, err := p.js.Stream(ctx, p.cfg.Stream)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		return Tip{}, false, nil
	}
	if err != nil {
		return Tip{}, false, fmt.Errorf("look up stream %q: %w", p.cfg.Stream, err)
	}
	filter := p.cfg.SubjectPrefix + ".>"
	m, err := st.GetLastMsgForSubject(ctx, filter)
	if errors.Is(err, jetstream.ErrMsgNotFound) {
		return Tip{}, false, nil
	}
	if err != nil {
		return Tip{}, false, fmt.Errorf("read the last message on %s of stream %q: %w", filter, p.cfg.Stream, err)
	}
	if t, ok := tipOf(m.Sequence, m.Subject, m.Time, m.Header, writer); ok {
		p.rememberTip(writer, m.Sequence, t, true)
		return t, true, nil
	}
	// Another writer's: read back to this writer's last message.
	p.tipMu.Lock()
	seen := p.tipSeen
	p.tipMu.Unlock()
	from, t, found := st.CachedInfo().State.FirstSeq, Tip{}, false
	if seen.writer == writer && seen.through < m.Sequence && seen.through >= from {
		from, t, found = seen.through+1, seen.tip, seen.found
	}
	if m.Sequence-from > 10000 {
		p.log.Info().Uint64("from_seq", from).Uint64("to_seq", m.Sequence).Msg("the stream's last message on jetbox's subjects is another writer's: reading back to this database's last one")
	}
	err = scanHeaders(ctx, st, filter, from, m.Sequence, func(seq uint64, subject string, stored time.Time, h nats.Header) {
		if tt, ok := tipOf(seq, subject, stored, h, writer); ok {
			t, found = tt, true
		}
	})
	if err != nil {
		return Tip{}, false, fmt.Errorf("read the stream's messages on %s for this database's last one: %w", filter, err)
	}
	p.rememberTip(writer, m.Sequence, t, found)
	return t, found, nil
}

// tipSeen is how far Tip read the stream for a writer, and what it found.
type tipSeen struct {
	writer  string
	through uint64
	tip     Tip
	found   bool
}

func (p *Publisher) rememberTip(writer string, through uint64, t Tip, found bool) {
	p.tipMu.Lock()
	defer p.tipMu.Unlock()
	p.tipSeen = tipSeen{writer: writer, through: through, tip: t, found: found}
}

// tipOf returns the message at seq with headers h as a Tip, if writer stored it.
func tipOf(seq uint64, subject string, stored time.Time, h nats.Header, writer string) (Tip, bool) {
	pos, ok := format.ParsePosition(h)
	src := h.Get(format.HeaderSource)
	o, parsed := format.ParseOrigin(src)
	if !ok || !parsed || o.Writer() != writer {
		return Tip{}, false
	}
	return Tip{Seq: seq, Origin: src, CommitLSN: pglogrepl.LSN(pos.CommitLSN), TxIndex: pos.TxIndex, ID: h.Get(jetstream.MsgIDHeader), RowID: h.Get(format.HeaderRowID),
		CommitTime: h.Get(format.HeaderCommitTime), Scheme: h.Get(format.HeaderIndexScheme), Routing: h.Get(format.HeaderRouting), TxLast: h.Get(format.HeaderTxLast) == "true",
		AggregateType: h.Get(format.HeaderAggregateType), AggregateID: h.Get(format.HeaderAggregateID), EventType: h.Get(format.HeaderEventType),
		Stored: stored, RepairSince: h.Get(format.HeaderRepairSince), Subject: subject}, true
}

// scanHeaders calls fn for every message on filter ("": any subject) from
// sequence from to through (inclusive), in order, reading headers only
// with an ordered consumer.
func scanHeaders(ctx context.Context, st jetstream.Stream, filter string, from, through uint64, fn func(seq uint64, subject string, stored time.Time, h nats.Header)) error {
	if from > through {
		return nil
	}
	cc := jetstream.OrderedConsumerConfig{HeadersOnly: true, DeliverPolicy: jetstream.DeliverByStartSequencePolicy, OptStartSeq: from,
		InactiveThreshold: 10 * time.Second}
	if filter != "" {
		cc.FilterSubjects = []string{filter}
	}
	cons, err := st.OrderedConsumer(ctx, cc)
	if err != nil {
		return err
	}
	defer func() { // its interest would hold messages of an Interest stream
		if info := cons.CachedInfo(); info != nil {
			dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Second)
			defer cancel()
			_ = st.DeleteConsumer(dctx, info.Name)
		}
	}()
	it, err := cons.Messages(jetstream.PullMaxMessages(4096))
	if err != nil {
		return err
	}
	defer it.Stop()
	for {
		m, err := it.Next(jetstream.NextContext(ctx))
		if err != nil {
			return err
		}
		md, err := m.Metadata()
		if err != nil {
			return err
		}
		if md.Sequence.Stream > through {
			return nil
		}
		fn(md.Sequence.Stream, m.Subject(), md.Timestamp, m.Headers())
		if md.Sequence.Stream == through || md.NumPending == 0 {
			return nil // through, or the last message there is (through deleted)
		}
	}
}

// ForgetHistory tells later sessions that the stream's messages up to seq
// come from a WAL history the server no longer continues (an operator
// accepted lost rows after a rewind or a failover): exactly-once mode then
// skips no event by position against them. The slot replays what the
// server still shares with that history from from on: an event there is
// skipped only where the stream holds the same id at the same position
// (read once, back from seq, for source's writer), so the shared part is
// not stored again once the duplicate window has passed, and the rest is
// published.
func (p *Publisher) ForgetHistory(seq uint64, source string, from format.Position) {
	writer := source
	if o, ok := format.ParseOrigin(source); ok {
		writer = o.Writer()
	}
	p.forgetMu.Lock()
	p.forgotten = &forgotten{seq: seq, writer: writer, from: from}
	p.forgetMu.Unlock()
	p.forgetThrough.Store(seq)
}

// ForgetPositionsThrough is ForgetHistory with nothing replayed.
func (p *Publisher) ForgetPositionsThrough(seq uint64) { p.forgetThrough.Store(seq) }

// forgotten is an accepted lost history (ForgetHistory).
type forgotten struct {
	seq     uint64
	writer  string
	from    format.Position
	index   map[format.Position]string // what the stream holds of it from from on; nil until read
	partial bool                       // more than maxAbandoned messages: not all are in index
}

// maxAbandoned bounds the index of an abandoned history (about 100 bytes each).
const maxAbandoned = 1_000_000

// abandonedIndex returns what the stream holds of the abandoned history at
// the positions the slot replays (nil: none forgotten), reading it once.
func (p *Publisher) abandonedIndex(ctx context.Context) (map[format.Position]string, error) {
	p.forgetMu.Lock()
	defer p.forgetMu.Unlock()
	f := p.forgotten
	if f == nil || f.index != nil {
		if f == nil {
			return nil, nil
		}
		return f.index, nil
	}
	ctx, cancel := context.WithTimeout(ctx, 5*time.Minute)
	defer cancel()
	st, err := p.js.Stream(ctx, p.cfg.Stream)
	if err != nil {
		return nil, fmt.Errorf("look up stream %q: %w", p.cfg.Stream, err)
	}
	index := map[format.Position]string{}
	first := st.CachedInfo().State.FirstSeq
	const page = 10_000
	for end := f.seq; end >= first && end > 0 && !f.partial; {
		start := max(first, end-min(end, page-1))
		older := false // a message of the writer before from: the rest is older (positions increase)
		err := scanHeaders(ctx, st, "", start, end, func(seq uint64, _ string, _ time.Time, h nats.Header) {
			pos, ok := format.ParsePosition(h)
			o, parsed := format.ParseOrigin(h.Get(format.HeaderSource))
			if !ok || !parsed || o.Writer() != f.writer {
				return
			}
			if pos.Less(f.from) {
				older = true
				return
			}
			if len(index) >= maxAbandoned {
				f.partial = true
				return
			}
			index[pos] = h.Get(jetstream.MsgIDHeader)
		})
		if err != nil {
			return nil, fmt.Errorf("read the abandoned history's messages (seq %d-%d): %w", start, end, err)
		}
		if older || start == first || start == 0 {
			break
		}
		end = start - 1
	}
	if f.partial {
		p.log.Warn().Int("messages", len(index)).Msg("the abandoned history holds more messages than jetbox indexes: the slot's replay of the older ones may be stored again once the duplicate window has passed")
	}
	p.log.Info().Int("messages", len(index)).Str("from", pglogrepl.LSN(f.from.CommitLSN).String()).Msg("accepted lost history: skipping the slot's replay of what the stream holds of it, message by message")
	f.index = index
	return index, nil
}
