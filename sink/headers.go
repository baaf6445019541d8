package sink

import (
	"fmt"
	"net/textproto"
	"strconv"

	"github.com/jackc/pglogrepl"
	"github.com/jetbox-dev/jetbox/decoder"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// Header names jetbox sets on its messages, for consumers and tools that read
// them (docs/guarantees.md, "The messages and their positions"). Dead letters
// carry the decoder.HeaderDeadLetter* headers besides.
const (
	HeaderAggregateType = "Jetbox-Aggregate-Type"
	HeaderAggregateID   = "Jetbox-Aggregate-Id"
	HeaderEventType     = "Jetbox-Event-Type"
	HeaderCommitLSN     = "Jetbox-Commit-LSN" // the transaction's commit LSN, X/X form
	HeaderCommitTime    = "Jetbox-Commit-Time"
	HeaderTxIndex       = "Jetbox-Tx-Index" // the event's place among its transaction's outbox rows and messages together, from 0
	HeaderSource        = "Jetbox-Source"   // <system id>/<timeline>/<database>/<slot>
	// HeaderIndexScheme says how Jetbox-Tx-Index counted (decoder.Config.
	// IndexScheme): absent with --source=table, else e.g.
	// "table,messages:jetbox". The same transaction read under another
	// scheme numbers its events differently.
	HeaderIndexScheme = "Jetbox-Index-Scheme"
	// HeaderRouting says how the message was routed and stored
	// (decoder.Config.RoutingHeader): absent under the default subject
	// template without atomic batches, else space-separated fields, e.g.
	// "template={prefix}.{aggregate_type}.{partition}.{event_type}
	// partitions=16 atomic". A restart under another routing would move
	// aggregates to other subjects (replication checks it).
	HeaderRouting = "Jetbox-Routing"
	// HeaderTxLast is "true" on the last message of each transaction when
	// transactions are published atomically (Config.AtomicTransactions).
	HeaderTxLast = "Jetbox-Tx-Last"
	// HeaderRepaired marks a message jetbox repair published from the table.
	HeaderRepaired = "Jetbox-Repaired"
	// HeaderRepairSince is on every message of a jetbox repair: where its
	// range starts (RFC 3339, or "all"), so that a re-run of an interrupted
	// repair covers the same rows.
	HeaderRepairSince = "Jetbox-Repair-Since"
)

// CommitTimeLayout is the format of Jetbox-Commit-Time: RFC 3339 in UTC with
// nanoseconds always printed, so the strings sort like the times.
const CommitTimeLayout = "2006-01-02T15:04:05.000000000Z07:00"

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
	field(HeaderAggregateType, ev.AggregateType)
	field(HeaderAggregateID, ev.AggregateID)
	field(HeaderEventType, ev.EventType)
	n += len(HeaderCommitLSN) + hexDigits(uint32(ev.CommitLSN>>32)) + 1 + hexDigits(uint32(ev.CommitLSN)) + 4
	n += len(HeaderCommitTime) + len(CommitTimeLayout) - len("Z07:00") + len("Z") + 4 // always UTC
	n += len(HeaderTxIndex) + decimalDigits(ev.TxIndex) + 4
	if ev.Source != "" {
		field(HeaderSource, ev.Source)
	}
	if indexScheme != "" {
		field(HeaderIndexScheme, indexScheme)
	}
	if routing != "" {
		field(HeaderRouting, routing)
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

// Position is where a message's row comes from in the WAL: Jetbox-Commit-LSN
// (commit order), then Jetbox-Tx-Index (the row's order in its transaction).
//
// For a consumer it is more than the duplicate window gives. Nats-Msg-Id
// drops a replay only while the original is inside the stream's duplicate
// window; a Position orders the messages of one Jetbox-Source at any age.
// With the order guard on (the default, and always with exactly-once
// delivery) the stream holds each source's first copies in position order,
// so a consumer that keeps the highest Position it processed (one value per
// source, not a set of ids) can skip any message at or before it: a replay
// stored again after the window (dedup mode after a slot rewind or a long
// outage), or a redelivery. With exactly-once delivery positions strictly
// increase along the stream. Positions of different sources (databases,
// slots, clusters) are not comparable.
type Position struct {
	CommitLSN uint64
	TxIndex   int
}

// ParsePosition reads a message's Position from its Jetbox-Commit-LSN and
// Jetbox-Tx-Index headers; ok is false when either is missing or malformed
// (a message jetbox did not write).
func ParsePosition(h nats.Header) (pos Position, ok bool) {
	text := h.Get(HeaderCommitLSN)
	if text == "" {
		return Position{}, false
	}
	lsn, err := pglogrepl.ParseLSN(text)
	if err != nil {
		return Position{}, false
	}
	idx, err := strconv.Atoi(h.Get(HeaderTxIndex))
	if err != nil {
		return Position{}, false
	}
	return Position{CommitLSN: uint64(lsn), TxIndex: idx}, true
}

// Less reports whether p comes before q.
func (p Position) Less(q Position) bool { return p.Compare(q) < 0 }

// Compare returns -1 if p comes before q, 0 if they are the same, +1 if p
// comes after q.
func (p Position) Compare(q Position) int {
	switch {
	case p.CommitLSN < q.CommitLSN:
		return -1
	case p.CommitLSN > q.CommitLSN:
		return 1
	case p.TxIndex < q.TxIndex:
		return -1
	case p.TxIndex > q.TxIndex:
		return 1
	}
	return 0
}

// String returns the position as <commit LSN>#<tx index>, e.g. 0/16B3748#2.
func (p Position) String() string {
	return fmt.Sprintf("%s#%d", pglogrepl.LSN(p.CommitLSN), p.TxIndex)
}
