package sink

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jetbox-dev/jetbox/sink/format"

	"github.com/nats-io/nats.go/jetstream"
)

// OpenRepair starts a session for jetbox repair. It is Open, except that in
// exactly-once mode the stream's last message may come from another jetbox
// source (the slot was lost in a failover or a restore): the repair starts
// the new slot's history, so it resumes after nothing of it. A last message
// from the same source is resumed after, as Open does.
func (p *Publisher) OpenRepair(ctx context.Context, source string) (*Session, error) {
	return p.open(ctx, source, true)
}

// StoredIDs returns the row ids of the messages the stream stored at or
// after since (the server's time; zero: the whole stream), up to its last
// message now: Nats-Msg-Id, and Jetbox-Row-Id of dead letters, each with
// its Jetbox-Commit-Time in Unix microseconds (0 when it has none). It
// reads headers only, with an ordered consumer.
func (p *Publisher) StoredIDs(ctx context.Context, since time.Time) (map[string]int64, error) {
	ids := map[string]int64{}
	st, err := p.js.Stream(ctx, p.cfg.Stream)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		return ids, nil
	}
	if err != nil {
		return nil, fmt.Errorf("look up stream %q: %w", p.cfg.Stream, err)
	}
	last := st.CachedInfo().State.LastSeq
	if last == 0 {
		return ids, nil
	}
	cc := jetstream.OrderedConsumerConfig{HeadersOnly: true, DeliverPolicy: jetstream.DeliverAllPolicy}
	if !since.IsZero() {
		m, err := st.GetMsg(ctx, last)
		if err != nil {
			return nil, fmt.Errorf("read the stream's last message (seq %d): %w", last, err)
		}
		if m.Time.Before(since) {
			return ids, nil
		}
		cc.DeliverPolicy, cc.OptStartTime = jetstream.DeliverByStartTimePolicy, &since
	}
	cons, err := st.OrderedConsumer(ctx, cc)
	if err != nil {
		return nil, fmt.Errorf("read the ids of stream %q: %w", p.cfg.Stream, err)
	}
	it, err := cons.Messages(jetstream.PullMaxMessages(4096))
	if err != nil {
		return nil, fmt.Errorf("read the ids of stream %q: %w", p.cfg.Stream, err)
	}
	defer it.Stop()
	for {
		m, err := it.Next(jetstream.NextContext(ctx))
		if err != nil {
			return nil, fmt.Errorf("read the ids of stream %q (%d read): %w", p.cfg.Stream, len(ids), err)
		}
		h := m.Headers()
		var committed int64
		if t, err := time.Parse(time.RFC3339Nano, h.Get(format.HeaderCommitTime)); err == nil && t.Year() > 1 {
			committed = t.UnixMicro()
		}
		ids[h.Get(jetstream.MsgIDHeader)] = committed
		if row := h.Get(format.HeaderRowID); row != "" {
			ids[row] = committed
		}
		md, err := m.Metadata()
		if err != nil {
			return nil, fmt.Errorf("read the ids of stream %q: %w", p.cfg.Stream, err)
		}
		if md.Sequence.Stream >= last {
			return ids, nil
		}
	}
}
