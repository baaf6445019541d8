package decoder

import (
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/jetbox-dev/jetbox/sink/format"

	"github.com/jackc/pglogrepl"
)

// DeadLetter returns the event that replaces ev, which cannot be published
// for cause: subject <DeadLetterSubject>.<cause.Code>, the row's payload
// (or, when it does not fit, and always for a too-large row, a JSON
// reference to the row), headers naming the reason, the row id, its LSN
// and original subject. Its Nats-Msg-Id is
// derived from the row's position, so replays of it are deduplicated and it
// never collides with a row id. Values from the row are escaped to be safe
// as headers.
func (c Config) DeadLetter(ev *Event, cause *InvalidEventError) Event {
	dl := Event{
		ID:            DeadLetterID(ev.CommitLSN, ev.TxIndex),
		Subject:       c.DeadLetterSubject + "." + cause.Code,
		AggregateType: escape(ev.AggregateType, 256),
		AggregateID:   escape(ev.AggregateID, 256),
		EventType:     escape(ev.EventType, 256),
		Payload:       ev.Payload,
		CommitLSN:     ev.CommitLSN,
		CommitTime:    ev.CommitTime,
		TxIndex:       ev.TxIndex,
		XID:           ev.XID,
		Origin:        ev.Origin,
		DeadLetter:    cause,
	}
	orig := ev.Subject // set when the subject was not the problem
	if orig == "" {
		orig = c.SubjectPrefix + "." + ev.AggregateType + "." + ev.EventType
	}
	base := []Header{
		{format.HeaderDeadLetterError, escape(cause.Error(), 1024)},
		{format.HeaderDeadLetterReason, cause.Code},
		{format.HeaderOriginalSubject, escape(orig, 512)},
		{format.HeaderRowID, RowIDHeader(ev.ID)},
	}
	source := map[string]any{"table": c.Schema + "." + c.Table}
	if ev.messagePrefix != "" {
		base = append(base, Header{format.HeaderMessagePrefix, escape(ev.messagePrefix, 256)})
		source = map[string]any{"message_prefix": ev.messagePrefix}
	} else {
		base = append(base, Header{format.HeaderTable, c.Schema + "." + c.Table})
	}
	if ev.rawHeaders != "" {
		base = append(base, Header{format.HeaderOriginalHeaders, escape(ev.rawHeaders, 4096)})
	}
	// The row's own headers, when they were not the problem.
	dl.Headers = append(append([]Header(nil), base...), ev.Headers...)
	// A too-large row's payload never fits, even when the limit was
	// lowered after MaxMessageSize was read.
	if cause.Code == format.ReasonTooLarge || (c.MaxMessageSize > 0 && c.size(&dl)+perPublishHeaders > c.MaxMessageSize) {
		source["id"], source["commit_lsn"], source["tx_index"] = ev.ID, ev.CommitLSN.String(), ev.TxIndex
		ref, _ := json.Marshal(source)
		dl.Payload = ref
		dl.Headers = append(base, Header{format.HeaderPayloadOmitted, "true"}, Header{format.HeaderPayloadSize, strconv.Itoa(len(ev.Payload))})
	}
	return dl
}

// DeadLetterID is the Nats-Msg-Id of the dead letter of the row at
// (commitLSN, txIndex).
func DeadLetterID(commitLSN pglogrepl.LSN, txIndex int) string {
	return fmt.Sprintf("jetbox-dlq-%s-%d", commitLSN, txIndex)
}

// RowIDHeader is the Jetbox-Row-Id value of a dead letter of the row with id.
func RowIDHeader(id string) string { return escape(id, 256) }

// escape makes s safe as a header value: printable, valid UTF-8, at most
// max bytes, anything else written as a Go escape (\n, \x00...), and
// "Nats-" written "Nats_" (see mentionsNATSHeader).
func escape(s string, max int) string {
	s = strings.ReplaceAll(s, "Nats-", "Nats_")
	if printable(s) && utf8.ValidString(s) && len(s) <= max {
		return s
	}
	q := strconv.QuoteToASCII(s)
	q = q[1 : len(q)-1]
	if len(q) > max {
		q = q[:max] + "..."
	}
	return q
}
