package sink

import (
	"net/textproto"

	"github.com/jetbox-dev/jetbox/sink/format"

	"github.com/jetbox-dev/jetbox/decoder"
	"github.com/nats-io/nats.go/jetstream"
)

// MessageSize is the size of ev's message as NATS counts it against
// max_payload and a stream's max_msg_size (the payload and the header
// block), with the headers every publish of it carries: the row's,
// jetbox's (indexScheme and routing: Config.IndexScheme and Config.Routing)
// and Nats-Msg-Id. What one
// publish adds on its own (the order guard's expected sequence and last
// id, an atomic batch's headers, a trace context) is left out: it is a
// lower bound (decoder.Config.Size), and what is still too large is
// refused exactly when it is published.
func MessageSize(ev *decoder.Event, indexScheme, routing string) int {
	n := len(ev.Payload) + len("NATS/1.0\r\n") + len("\r\n")
	field := func(k, v string) { n += len(k) + len(textproto.TrimString(v)) + 4 } // "k: v\r\n"
	for _, h := range ev.Headers {
		field(h.Key, h.Value)
	}
	field(format.HeaderAggregateType, ev.AggregateType)
	field(format.HeaderAggregateID, ev.AggregateID)
	field(format.HeaderEventType, ev.EventType)
	n += len(format.HeaderCommitLSN) + hexDigits(uint32(ev.CommitLSN>>32)) + 1 + hexDigits(uint32(ev.CommitLSN)) + 4
	n += len(format.HeaderCommitTime) + len(format.CommitTimeLayout) - len("Z07:00") + len("Z") + 4 // always UTC
	n += len(format.HeaderTxIndex) + decimalDigits(ev.TxIndex) + 4
	if ev.Origin != "" {
		field(format.HeaderSource, ev.Origin)
	}
	if indexScheme != "" {
		field(format.HeaderIndexScheme, indexScheme)
	}
	if routing != "" {
		field(format.HeaderRouting, routing)
	}
	field(jetstream.MsgIDHeader, ev.ID)
	return n
}

func hexDigits(v uint32) int {
	n := 1
	for v >= 16 {
		v, n = v>>4, n+1
	}
	return n
}

func decimalDigits(v int) int {
	n := 1
	if v < 0 {
		v, n = -v, 2
	}
	for v >= 10 {
		v, n = v/10, n+1
	}
	return n
}
