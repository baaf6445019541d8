package decoder

import (
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"unicode/utf8"
)

// Headers of a dead letter, besides jetbox's usual ones (the position
// headers Jetbox-Commit-LSN and Jetbox-Tx-Index are those of the row).
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
		ID:            fmt.Sprintf("jetbox-dlq-%s-%d", ev.CommitLSN, ev.TxIndex),
		Subject:       c.DeadLetterSubject + "." + cause.Code,
		AggregateType: escape(ev.AggregateType, 256),
		AggregateID:   escape(ev.AggregateID, 256),
		EventType:     escape(ev.EventType, 256),
		Payload:       ev.Payload,
		CommitLSN:     ev.CommitLSN,
		CommitTime:    ev.CommitTime,
		TxIndex:       ev.TxIndex,
		XID:           ev.XID,
		Source:        ev.Source,
		DeadLetter:    cause,
	}
	orig := ev.Subject // set when the subject was not the problem
	if orig == "" {
		orig = c.SubjectPrefix + "." + ev.AggregateType + "." + ev.EventType
	}
	base := []Header{
		{HeaderDeadLetterError, escape(cause.Error(), 1024)},
		{HeaderDeadLetterReason, cause.Code},
		{HeaderOriginalSubject, escape(orig, 512)},
		{HeaderRowID, escape(ev.ID, 256)},
	}
	source := map[string]any{"table": c.Schema + "." + c.Table}
	if ev.messagePrefix != "" {
		base = append(base, Header{HeaderMessagePrefix, escape(ev.messagePrefix, 256)})
		source = map[string]any{"message_prefix": ev.messagePrefix}
	} else {
		base = append(base, Header{HeaderTable, c.Schema + "." + c.Table})
	}
	if ev.rawHeaders != "" {
		base = append(base, Header{HeaderOriginalHeaders, escape(ev.rawHeaders, 4096)})
	}
	// The row's own headers, when they were not the problem.
	dl.Headers = append(append([]Header(nil), base...), ev.Headers...)
	// A too-large row's payload never fits, even when the limit was
	// lowered after MaxMessageSize was read.
	if cause.Code == ReasonTooLarge || (c.MaxMessageSize > 0 && dl.WireSize()+c.settingsHeaderSize() > c.MaxMessageSize) {
		source["id"], source["commit_lsn"], source["tx_index"] = ev.ID, ev.CommitLSN.String(), ev.TxIndex
		ref, _ := json.Marshal(source)
		dl.Payload = ref
		dl.Headers = append(base, Header{HeaderPayloadOmitted, "true"}, Header{HeaderPayloadSize, strconv.Itoa(len(ev.Payload))})
	}
	return dl
}

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
