package sink

import (
	"strings"
	"testing"
	"time"

	"github.com/jetbox-dev/jetbox/sink/format"

	"github.com/jackc/pglogrepl"
	"github.com/jetbox-dev/jetbox/decoder"
	"github.com/jetbox-dev/jetbox/internal/metrics"
	"github.com/nats-io/nats.go"
)

// TestMessageSize: MessageSize counts, byte for byte as nats.go does, the
// message every publish of an event carries (its Jetbox-Source and index
// scheme included), and no more: the headers one publish adds on its own
// come on top.
func TestMessageSize(t *testing.T) {
	p := &Publisher{cfg: Config{IndexScheme: "table,messages:jetbox", Routing: "template={prefix}.{aggregate_type}.{partition}.{event_type} partitions=4 atomic"}}
	for _, ev := range []*decoder.Event{
		{ID: "a", Subject: "outbox.order.Created", AggregateType: "order", AggregateID: "1", EventType: "Created", Payload: []byte(`{}`)},
		{ID: strings.Repeat("i", 200), Subject: "outbox.o.E", AggregateType: "o", AggregateID: strings.Repeat("x", 300), EventType: "E",
			Payload: []byte(strings.Repeat("p", 9000)), CommitLSN: 0xFFFFFFFF_0000ABCD, TxIndex: 123456,
			CommitTime: time.Date(2026, 1, 2, 3, 4, 5, 0, time.FixedZone("x", 3600)),
			Origin:     "7300000000000000001/12/app%2Fdb/jetbox", Headers: []decoder.Header{{Key: "traceparent", Value: " 00-1 "}, {Key: "X-A", Value: ""}}},
	} {
		var tx txText
		h := p.header(ev, &tx, 0)
		msg := &nats.Msg{Subject: ev.Subject, Header: h, Data: ev.Payload}
		if got, want := p.MessageSize(ev), msg.Size()-len(msg.Subject); got != want {
			t.Errorf("MessageSize %d, nats.go counts %d (headers %v)", got, want, h)
		}
	}
}

// TestSkipHeldTrustsOnlyExactlyOnceResume: a row that cannot be published
// is skipped as held only where exactly-once resume proved the stream
// holds every event of this source up to its last one: not after an
// accepted lost history (a watermark of the abandoned one proves nothing),
// and never in dedup mode (a run without the order guard may have left a
// gap before the tip).
func TestSkipHeldTrustsOnlyExactlyOnceResume(t *testing.T) {
	const src = "7300000000000000001/1/app/jetbox"
	tip := format.Position{CommitLSN: 0x5000, TxIndex: 3}
	for _, c := range []struct {
		name   string
		exact  bool
		forget bool
		at     format.Position
		want   bool
	}{
		{"exactly-once, before the tip", true, false, format.Position{CommitLSN: 0x3000}, true},
		{"exactly-once, at the tip", true, false, tip, true},
		{"exactly-once, past the tip", true, false, format.Position{CommitLSN: 0x5000, TxIndex: 4}, false},
		{"exactly-once, after an accepted lost history", true, true, format.Position{CommitLSN: 0x3000}, false},
		{"dedup, before the tip", false, false, format.Position{CommitLSN: 0x3000}, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			p := &Publisher{cfg: Config{Delivery: map[bool]Delivery{true: ExactlyOnce, false: DedupGuarded}[c.exact], Metrics: metrics.New()}}
			p.replays = replays{source: src, hasWM: true, wm: watermark{Seq: 90, CommitLSN: tip.CommitLSN, TxIndex: tip.TxIndex}}
			cur := cursor{seq: 90, pos: tip, watermark: true, skip: c.exact, chain: c.exact}
			if c.forget {
				p.ForgetHistory(90, src, format.Position{CommitLSN: 0x1000})
				cur = cursor{seq: 90} // what resume gives after it
			}
			s := &Session{p: p, source: src, cur: cur}
			if got := s.SkipHeld(pglogrepl.LSN(c.at.CommitLSN), c.at.TxIndex); got != c.want {
				t.Fatalf("SkipHeld(%v) = %v, want %v", c.at, got, c.want)
			}
		})
	}
}
