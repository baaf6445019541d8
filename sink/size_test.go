package sink

import (
	"strings"
	"testing"
	"time"

	"github.com/jetbox-dev/jetbox/decoder"
	"github.com/nats-io/nats.go"
)

// TestMessageSize: MessageSize counts, byte for byte as nats.go does, the
// message every publish of an event carries (its Jetbox-Source and index
// scheme included), and no more: the headers one publish adds on its own
// come on top.
func TestMessageSize(t *testing.T) {
	p := &Publisher{cfg: Config{IndexScheme: "table,messages:jetbox"}}
	for _, ev := range []*decoder.Event{
		{ID: "a", Subject: "outbox.order.Created", AggregateType: "order", AggregateID: "1", EventType: "Created", Payload: []byte(`{}`)},
		{ID: strings.Repeat("i", 200), Subject: "outbox.o.E", AggregateType: "o", AggregateID: strings.Repeat("x", 300), EventType: "E",
			Payload: []byte(strings.Repeat("p", 9000)), CommitLSN: 0xFFFFFFFF_0000ABCD, TxIndex: 123456,
			CommitTime: time.Date(2026, 1, 2, 3, 4, 5, 0, time.FixedZone("x", 3600)),
			Source:     "7300000000000000001/12/app%2Fdb/jetbox", Headers: []decoder.Header{{Key: "traceparent", Value: " 00-1 "}, {Key: "X-A", Value: ""}}},
	} {
		var tx txText
		h := p.header(ev, &tx, 0)
		msg := &nats.Msg{Subject: ev.Subject, Header: h, Data: ev.Payload}
		if got, want := p.MessageSize(ev), msg.Size()-len(msg.Subject); got != want {
			t.Errorf("MessageSize %d, nats.go counts %d (headers %v)", got, want, h)
		}
	}
}
