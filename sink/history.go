package sink

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jetbox-dev/jetbox/decoder"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// Tip is the last message jetbox stored on its subjects: where the stream's
// history of a database ends.
type Tip struct {
	Seq        uint64
	Source     string // Jetbox-Source
	CommitLSN  pglogrepl.LSN
	TxIndex    int       // Jetbox-Tx-Index
	ID         string    // Nats-Msg-Id
	CommitTime string    // Jetbox-Commit-Time, as stored
	Scheme     string    // Jetbox-Index-Scheme: "" when absent (--source=table)
	Stored     time.Time // when the server stored it
	// RepairSince is Jetbox-Repair-Since: set on the rows and markers of
	// a jetbox repair, the start of the range it repairs.
	RepairSince string
	Subject     string
}

// Tip returns the last message on <prefix>.> that writer (a
// decoder.Origin's Writer: this system, database and slot) stored; ok is
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
	pos, ok := ParsePosition(h)
	src := h.Get(HeaderSource)
	o, parsed := decoder.ParseOrigin(src)
	if !ok || !parsed || o.Writer() != writer {
		return Tip{}, false
	}
	return Tip{Seq: seq, Source: src, CommitLSN: pglogrepl.LSN(pos.CommitLSN), TxIndex: pos.TxIndex, ID: h.Get(jetstream.MsgIDHeader),
		CommitTime: h.Get(HeaderCommitTime), Scheme: h.Get(HeaderIndexScheme), Stored: stored, RepairSince: h.Get(HeaderRepairSince), Subject: subject}, true
}

// scanHeaders calls fn for every message on filter from sequence from to
// through (inclusive), in order, reading headers only with an ordered
// consumer.
func scanHeaders(ctx context.Context, st jetstream.Stream, filter string, from, through uint64, fn func(seq uint64, subject string, stored time.Time, h nats.Header)) error {
	if from > through {
		return nil
	}
	cons, err := st.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{FilterSubjects: []string{filter}, HeadersOnly: true,
		DeliverPolicy: jetstream.DeliverByStartSequencePolicy, OptStartSeq: from, InactiveThreshold: 10 * time.Second})
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
		if md.Sequence.Stream == through {
			return nil
		}
	}
}

// ForgetPositionsThrough tells later sessions that the stream's messages up
// to seq come from a WAL history the server no longer continues (an
// operator accepted lost rows after a rewind or a failover): exactly-once
// mode then skips no event by position against them.
func (p *Publisher) ForgetPositionsThrough(seq uint64) { p.forgetThrough.Store(seq) }
