// Package format is the format of jetbox's messages, for consumers and
// tools that read them, and for every part of jetbox that writes them: the
// header names, a message's Position and its Origin (Jetbox-Source), the
// subject tokens jetbox reserves and the reasons a row cannot be published.
// It depends on the standard library only, so a consumer importing it pulls
// in nothing else (docs/guarantees.md, "The messages and their positions").
package format

import (
	"fmt"
	"net/url"
	"strconv"
	"strings"
)

// Headers jetbox sets on every message.
const (
	HeaderAggregateType = "Jetbox-Aggregate-Type"
	HeaderAggregateID   = "Jetbox-Aggregate-Id"
	HeaderEventType     = "Jetbox-Event-Type"
	HeaderCommitLSN     = "Jetbox-Commit-LSN" // the transaction's commit LSN, X/X form
	HeaderCommitTime    = "Jetbox-Commit-Time"
	HeaderTxIndex       = "Jetbox-Tx-Index" // the event's place among its transaction's outbox rows and messages together, from 0
	// HeaderSource is the event's Origin: the WAL history its row comes
	// from, <system id>/<timeline>/<database>/<slot>.
	HeaderSource = "Jetbox-Source"
	// HeaderIndexScheme says how Jetbox-Tx-Index counted: absent with
	// --source=table, else e.g. "table,messages:jetbox". The same
	// transaction read under another scheme numbers its events differently.
	HeaderIndexScheme = "Jetbox-Index-Scheme"
	// HeaderRouting says how the message was routed and stored: absent
	// under the default subject template without atomic transactions,
	// else e.g. "template={prefix}.{aggregate_type}.{partition}.{event_type}
	// partitions=4 atomic".
	HeaderRouting = "Jetbox-Routing"
	// HeaderTxLast is "true" on the last message of each transaction when
	// transactions are published atomically (--atomic-transactions).
	HeaderTxLast = "Jetbox-Tx-Last"
	// HeaderRepaired marks a message jetbox repair published from the table.
	HeaderRepaired = "Jetbox-Repaired"
	// HeaderRepairSince is on every message of a jetbox repair: where its
	// range starts (RFC 3339, or "all"), so that a re-run of an interrupted
	// repair covers the same rows.
	HeaderRepairSince = "Jetbox-Repair-Since"
)

// Headers of a dead letter, besides the usual ones (its position headers
// are those of the row).
const (
	HeaderDeadLetterReason = "Jetbox-Dead-Letter-Reason" // one of the Reason* codes
	HeaderDeadLetterError  = "Jetbox-Dead-Letter-Error"  // the full error, with its fix
	HeaderRowID            = "Jetbox-Row-Id"             // the row's id as it was (escaped)
	HeaderOriginalSubject  = "Jetbox-Original-Subject"   // the subject the row would have had
	HeaderTable            = "Jetbox-Table"
	HeaderMessagePrefix    = "Jetbox-Message-Prefix"   // instead of Jetbox-Table, for a logical decoding message
	HeaderOriginalHeaders  = "Jetbox-Original-Headers" // the headers column as it was (escaped)
	HeaderPayloadOmitted   = "Jetbox-Payload-Omitted"  // "true" when the payload did not fit
	HeaderPayloadSize      = "Jetbox-Payload-Size"
)

// CommitTimeLayout is the format of Jetbox-Commit-Time: RFC 3339 in UTC with
// nanoseconds always printed, so the strings sort like the times.
const CommitTimeLayout = "2006-01-02T15:04:05.000000000Z07:00"

// Subject tokens jetbox reserves after its subject prefix: a row value
// may not start a token with '_'.
const (
	// DeadLetterToken: dead letters go to <prefix>._dlq.<reason> unless
	// --dead-letter-subject names another subject.
	DeadLetterToken = "_dlq"
	// ProbeToken: <prefix>._jetbox.* is jetbox's own (the atomic publish
	// probe), never an event.
	ProbeToken = "_jetbox"
)

// DefaultDeadLetterSubject is where dead letters of subject prefix go by
// default: <prefix>._dlq (each then on <prefix>._dlq.<reason>).
func DefaultDeadLetterSubject(prefix string) string { return prefix + "." + DeadLetterToken }

// Reasons a row cannot be published. Each is one NATS subject token: with
// dead-lettering on, the dead letter goes to <dead-letter subject>.<reason>.
const (
	ReasonBadID          = "bad-id"           // NULL, empty, with control characters or holding "Nats-"
	ReasonNullColumn     = "null-column"      // aggregate_type, aggregate_id or event_type is NULL
	ReasonBadAggregateID = "bad-aggregate-id" // holds control characters (it is sent as a header)
	ReasonBadSubject     = "bad-subject"      // a value the subject template uses is not one subject token
	ReasonBadEnvelope    = "bad-envelope"     // a logical decoding message that is not a valid envelope
	ReasonNullPayload    = "null-payload"
	ReasonBadPayload     = "bad-payload"  // a value in a form jetbox cannot read
	ReasonBadHeaders     = "bad-headers"  // not a JSON object of string values, or reserved names
	ReasonTooLarge       = "too-large"    // over the server's max_payload or the stream's max_msg_size
	ReasonDuplicateID    = "duplicate-id" // the id of another row still inside the duplicate window
	// ReasonTableChanged: the table no longer has the outbox columns (DDL).
	// It concerns every row, so jetbox always stops on it.
	ReasonTableChanged = "table-changed"
)

// Reasons returns every reason a row cannot be published, in the order
// above; all but ReasonTableChanged can be dead-lettered.
func Reasons() []string {
	return []string{ReasonBadID, ReasonNullColumn, ReasonBadAggregateID, ReasonBadSubject, ReasonBadEnvelope, ReasonNullPayload,
		ReasonBadPayload, ReasonBadHeaders, ReasonTooLarge, ReasonDuplicateID, ReasonTableChanged}
}

// Position is where a message's row comes from in the WAL: Jetbox-Commit-LSN
// (commit order), then Jetbox-Tx-Index (the row's order in its transaction).
//
// For a consumer it is more than the duplicate window gives. Nats-Msg-Id
// drops a replay only while the original is inside the stream's duplicate
// window; a Position orders the messages of one Origin at any age.
// With the order guard on (the default, and always with exactly-once
// delivery) the stream holds each origin's first copies in position order,
// so a consumer that keeps the highest Position it processed (one value per
// origin writer, not a set of ids) can skip any message at or before it: a
// replay stored again after the window (dedup mode after a slot rewind or a
// long outage), or a redelivery. With exactly-once delivery positions
// strictly increase along the stream. Positions of different writers
// (databases, slots, clusters: Origin.Writer) are not comparable.
type Position struct {
	CommitLSN uint64
	TxIndex   int
}

// ParsePosition reads a message's Position from its Jetbox-Commit-LSN and
// Jetbox-Tx-Index headers (h is a nats.Header, or any header map keyed by
// the names as jetbox sets them); ok is false when either is missing or
// malformed (a message jetbox did not write).
func ParsePosition(h map[string][]string) (pos Position, ok bool) {
	lsn, ok := ParseLSN(first(h, HeaderCommitLSN))
	if !ok {
		return Position{}, false
	}
	idx, err := strconv.Atoi(first(h, HeaderTxIndex))
	if err != nil || idx < 0 {
		return Position{}, false
	}
	return Position{CommitLSN: lsn, TxIndex: idx}, true
}

func first(h map[string][]string, key string) string {
	if v := h[key]; len(v) > 0 {
		return v[0]
	}
	return ""
}

// ParseLSN parses an LSN in PostgreSQL's X/X form (Jetbox-Commit-LSN).
func ParseLSN(s string) (lsn uint64, ok bool) {
	hi, lo, found := strings.Cut(s, "/")
	if !found {
		return 0, false
	}
	h, err1 := strconv.ParseUint(hi, 16, 32)
	l, err2 := strconv.ParseUint(lo, 16, 32)
	if err1 != nil || err2 != nil {
		return 0, false
	}
	return h<<32 | l, true
}

// FormatLSN writes lsn in PostgreSQL's X/X form.
func FormatLSN(lsn uint64) string { return fmt.Sprintf("%X/%X", uint32(lsn>>32), uint32(lsn)) }

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
func (p Position) String() string { return fmt.Sprintf("%s#%d", FormatLSN(p.CommitLSN), p.TxIndex) }

// Origin is the WAL history an event comes from, as Jetbox-Source carries
// it: the cluster (its system identifier), the timeline, the database and
// the slot. Positions compare only between events of one writer (the same
// system, database and slot); the timeline says which branch of its WAL.
type Origin struct {
	SystemID string
	Timeline int32
	Database string
	Slot     string
}

// String encodes o as "<system id>/<timeline>/<database>/<slot>", with the
// database and slot path-escaped (a database name may hold '/'), so the
// encoding is unambiguous: the same text as before escaping for every name
// without '/', '%' or characters a URL path escapes.
func (o Origin) String() string {
	return fmt.Sprintf("%s/%d/%s/%s", o.SystemID, o.Timeline, url.PathEscape(o.Database), url.PathEscape(o.Slot))
}

// ParseOrigin parses a Jetbox-Source value; ok is false for any other text.
func ParseOrigin(s string) (o Origin, ok bool) {
	parts := strings.Split(s, "/")
	if len(parts) != 4 || parts[0] == "" {
		return Origin{}, false
	}
	tl, err := strconv.ParseInt(parts[1], 10, 32)
	if err != nil {
		return Origin{}, false
	}
	db, err1 := url.PathUnescape(parts[2])
	slot, err2 := url.PathUnescape(parts[3])
	if err1 != nil || err2 != nil {
		return Origin{}, false
	}
	return Origin{SystemID: parts[0], Timeline: int32(tl), Database: db, Slot: slot}, true
}

// Writer is o without its timeline: the system, database and slot whose
// positions compare (a failover keeps the writer).
func (o Origin) Writer() string { return o.SystemID + "/" + o.Database + "/" + o.Slot }

// SameWriter reports whether two Jetbox-Source values name the same system,
// database and slot, whatever their timelines. A value that does not parse
// is only its own writer.
func SameWriter(a, b string) bool {
	oa, oka := ParseOrigin(a)
	ob, okb := ParseOrigin(b)
	if !oka || !okb {
		return a == b
	}
	return oa.Writer() == ob.Writer()
}
