package sink

import (
	"net/textproto"
	"strconv"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jetbox-dev/jetbox/sink/format"

	"github.com/jetbox-dev/jetbox/decoder"
	"github.com/nats-io/nats.go"
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

// txText is a transaction's header values, formatted once for all its rows.
type txText struct {
	lsn            pglogrepl.LSN
	time           time.Time
	lsnText, ctime string
}

// header returns ev's message headers: the row's own, jetbox's and the
// message id, with room for extra more. tx caches the strings of ev's
// transaction.
//
// No Nats-Expected-Stream: the server would scan for it in every message
// and store it with each. What it protected (an ack from another stream
// that took over the subjects) is checked on every PubAck's stream instead
// (see checkStream); resume checks at every session open that the stream
// still captures the subjects.
func (p *Publisher) header(ev *decoder.Event, tx *txText, extra int) nats.Header {
	n := 10 + len(ev.Headers)
	h := make(nats.Header, n+extra)
	p.fillHeader(h, make([]string, 0, n), ev, tx)
	return h
}

// fillHeader sets ev's headers (see header) in h, their values in vals'
// storage (one backing array, not a slice per value), and returns vals.
func (p *Publisher) fillHeader(h nats.Header, vals []string, ev *decoder.Event, tx *txText) []string {
	// Header keys are set canonical and directly (not through publish
	// options): the hot path then skips re-canonicalising every key.
	for _, uh := range ev.Headers {
		vals = setHeader(h, vals, uh.Key, uh.Value) // keep the producer's spelling (traceparent)
	}
	// One transaction's events share both (a repair's rows share a commit
	// LSN, each with its own time).
	if ev.CommitLSN != tx.lsn || tx.lsnText == "" || !ev.CommitTime.Equal(tx.time) {
		tx.lsn, tx.time, tx.lsnText, tx.ctime = ev.CommitLSN, ev.CommitTime, ev.CommitLSN.String(), ev.CommitTime.UTC().Format(format.CommitTimeLayout)
	}
	vals = setHeader(h, vals, format.HeaderAggregateType, ev.AggregateType)
	vals = setHeader(h, vals, format.HeaderAggregateID, ev.AggregateID)
	vals = setHeader(h, vals, format.HeaderEventType, ev.EventType)
	vals = setHeader(h, vals, format.HeaderCommitLSN, tx.lsnText)
	vals = setHeader(h, vals, format.HeaderCommitTime, tx.ctime)
	vals = setHeader(h, vals, format.HeaderTxIndex, strconv.Itoa(ev.TxIndex))
	if ev.Origin != "" {
		vals = setHeader(h, vals, format.HeaderSource, ev.Origin)
	}
	if p.cfg.IndexScheme != "" {
		vals = setHeader(h, vals, format.HeaderIndexScheme, p.cfg.IndexScheme)
	}
	if p.cfg.Routing != "" {
		vals = setHeader(h, vals, format.HeaderRouting, p.cfg.Routing)
	}
	return setHeader(h, vals, jetstream.MsgIDHeader, ev.ID)
}

// setHeader sets h[k] to the one value v, stored in vals: the slice is
// capped at it, so an append to one header never writes into the next.
func setHeader(h nats.Header, vals []string, k, v string) []string {
	vals = append(vals, v)
	h[k] = vals[len(vals)-1 : len(vals) : len(vals)]
	return vals
}

func headerSize(h nats.Header) int {
	n := 12
	for k, vs := range h {
		for _, v := range vs {
			n += len(k) + len(v) + 4
		}
	}
	return n
}
