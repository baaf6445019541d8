package decoder

import (
	"bytes"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"strings"
	"unicode/utf8"

	"github.com/jetbox-dev/jetbox/sink/format"

	"github.com/jackc/pglogrepl"
)

// HeartbeatPrefix is the logical message prefix of jetbox's heartbeats.
const HeartbeatPrefix = "jetbox-heartbeat"

// DefaultMessagePrefix is the default prefix of outbox messages.
const DefaultMessagePrefix = "jetbox"

// MaxMessagePrefix is the longest Config.MessagePrefix: it is a header
// value (Jetbox-Index-Scheme on every message) and a label.
const MaxMessagePrefix = 128

// ValidMessagePrefix checks a Config.MessagePrefix: it goes as it is into
// the Jetbox-Index-Scheme header of every message, which a restart reads
// back and compares, so it must survive as a header value: valid UTF-8,
// no control characters (a CR or LF would end the header), no space at
// either end (a NATS client trims it on read), no "Nats-" (see
// mentionsNATSHeader: it could hide Nats-Msg-Id from a 2.10 server), and
// not the heartbeats' prefix.
func ValidMessagePrefix(p string) error {
	switch {
	case p == "":
		return fmt.Errorf("empty")
	case p == HeartbeatPrefix:
		return fmt.Errorf("the prefix of jetbox's own heartbeats")
	case !utf8.ValidString(p):
		return fmt.Errorf("not valid UTF-8")
	case !printable(p):
		return fmt.Errorf("holds a control character (CR, LF, tab...), which would end the Jetbox-Index-Scheme header every message carries")
	case strings.TrimSpace(p) != p:
		return fmt.Errorf("starts or ends with a space, which NATS clients trim from the header every message carries: a restart would read another prefix back")
	case mentionsNATSHeader(p):
		return fmt.Errorf("holds \"Nats-\": NATS servers before 2.11 find their headers by text search, so the Jetbox-Index-Scheme header could hide Nats-Msg-Id (no dedup) or the order guard")
	case len(p) > MaxMessagePrefix:
		return fmt.Errorf("%d bytes, over %d", len(p), MaxMessagePrefix)
	}
	return nil
}

// Why a logical decoding message published nothing (Message.Ignored).
const (
	IgnoredHeartbeat        = "heartbeat"         // jetbox's own heartbeat
	IgnoredNonTransactional = "non-transactional" // the outbox prefix, but pg_logical_emit_message(false, ...)
	IgnoredOtherPrefix      = "other-prefix"      // another prefix: someone else's message
)

// Envelope fields. A message's content is one JSON object with these keys
// (others are an error, so a misspelt key is not silently dropped):
//
//	{"id": "…", "aggregate_type": "…", "aggregate_id": "…", "event_type": "…",
//	 "payload": <any JSON>, "headers": {"k": "v"}}
//
// payload is published as its JSON text; a binary payload goes in
// payload_base64 instead (standard base64, with padding), published as the
// decoded bytes. Exactly one of the two. headers is optional. Each field is
// checked like the outbox column of that name, with the same reasons.
var envelopeFields = []string{"id", "aggregate_type", "aggregate_id", "event_type", "payload", "headers"}

const fieldPayloadBase64 = "payload_base64"

// The relations an envelope is decoded through: its fields play the outbox
// columns, so the checks, reasons and dead letters are those of a row.
var (
	messageRelation       = &relation{name: "message", ncols: 6, outbox: true, id: 0, aggType: 1, aggID: 2, evType: 3, payload: 4, headers: 5, shared: true}
	messageRelationBase64 = &relation{name: "message", ncols: 6, outbox: true, id: 0, aggType: 1, aggID: 2, evType: 3, payload: 4, headers: 5, payloadBytea: true, shared: true}
)

func (d *Decoder) decodeMessage(src []byte) (Message, error) {
	var m pglogrepl.LogicalDecodingMessage
	if err := m.Decode(src); err != nil {
		return Message{}, fmt.Errorf("%w: %v", ErrProtocol, err)
	}
	switch {
	case m.Prefix == HeartbeatPrefix:
		return Message{Ignored: IgnoredHeartbeat}, nil
	case m.Prefix != d.cfg.MessagePrefix:
		return Message{Ignored: IgnoredOtherPrefix}, nil
	case !m.Transactional:
		return Message{Ignored: IgnoredNonTransactional}, nil
	}
	if !d.inTxn {
		return Message{}, fmt.Errorf("%w: transactional message outside a transaction", ErrProtocol)
	}
	index := d.index
	d.index++
	ev := Event{CommitLSN: d.commitLSN, CommitTime: d.commitTime, TxIndex: index, XID: d.xid, Origin: d.origin, messagePrefix: m.Prefix}
	if err := d.cfg.fillMessage(&ev, m.Content); err != nil {
		err.LSN, err.TxIndex = d.commitLSN, index
		if d.cfg.DeadLetterSubject == "" || !err.DeadLetterable() {
			return Message{}, err
		}
		return Message{Kind: KindEvent, Event: d.cfg.DeadLetter(&ev, err)}, nil
	}
	return Message{Kind: KindEvent, Event: ev}, nil
}

// fillMessage makes ev out of an envelope; on error, ev holds what could be
// read (the whole content as the payload when the envelope is unreadable).
func (c *Config) fillMessage(ev *Event, content []byte) *InvalidEventError {
	cols, base64Payload, err := parseEnvelope(content)
	if err != nil {
		ev.Payload = append([]byte(nil), content...)
		ie := invalid(format.ReasonBadEnvelope, "", "message content is not a jetbox envelope: "+err.Error(),
			`emit a JSON object {"id", "aggregate_type", "aggregate_id", "event_type", "payload" (or "payload_base64"), "headers"?}, e.g. with jetbox_emit() (see docs/routing.md)`)
		ie.Message = true
		return ie
	}
	r := messageRelation
	if base64Payload {
		r = messageRelationBase64
	}
	ie := r.fill(ev, cols, c)
	if ie != nil {
		ie.Message = true
	}
	return ie
}

// parseEnvelope reads an envelope into the columns of messageRelation:
// a field that is absent or JSON null is a NULL column, a string field its
// text, payload its JSON text (or, from payload_base64, Postgres' hex bytea
// form, so that the row rules apply), headers its JSON text.
func parseEnvelope(content []byte) (cols []column, base64Payload bool, err error) {
	if !utf8.Valid(content) {
		return nil, false, fmt.Errorf("not valid UTF-8")
	}
	dec := json.NewDecoder(bytes.NewReader(content))
	dec.UseNumber()
	tok, err := dec.Token()
	if err != nil {
		return nil, false, fmt.Errorf("not JSON: %v", err)
	}
	if tok != json.Delim('{') {
		return nil, false, fmt.Errorf("not a JSON object")
	}
	fields := map[string]json.RawMessage{}
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return nil, false, fmt.Errorf("not JSON: %v", err)
		}
		key, _ := tok.(string)
		var raw json.RawMessage
		if err := dec.Decode(&raw); err != nil {
			return nil, false, fmt.Errorf("field %q: not JSON: %v", key, err)
		}
		if !knownField(key) {
			return nil, false, fmt.Errorf("unknown field %q (fields: id, aggregate_type, aggregate_id, event_type, payload or payload_base64, headers)", key)
		}
		if _, dup := fields[key]; dup {
			return nil, false, fmt.Errorf("field %q appears twice", key)
		}
		fields[key] = raw
	}
	if _, err := dec.Token(); err != nil {
		return nil, false, fmt.Errorf("not JSON: %v", err)
	}
	if _, err := dec.Token(); err != io.EOF {
		return nil, false, fmt.Errorf("text after the JSON object")
	}
	cols = make([]column, len(envelopeFields))
	for i, name := range envelopeFields[:4] {
		raw, ok := fields[name]
		if !ok || isNull(raw) {
			cols[i].kind = 'n'
			continue
		}
		var v string
		if raw[0] != '"' || json.Unmarshal(raw, &v) != nil {
			return nil, false, fmt.Errorf("field %q is %s, not a string", name, jsonKind(raw))
		}
		cols[i] = column{kind: 't', data: []byte(v)}
	}
	payload, hasPayload := fields["payload"]
	b64, hasB64 := fields[fieldPayloadBase64]
	switch {
	case hasPayload && hasB64:
		return nil, false, fmt.Errorf("both payload and payload_base64 are set: use one")
	case hasB64 && !isNull(b64):
		var v string
		if b64[0] != '"' || json.Unmarshal(b64, &v) != nil {
			return nil, false, fmt.Errorf("field %q is %s, not a string", fieldPayloadBase64, jsonKind(b64))
		}
		bin, err := base64.StdEncoding.Strict().DecodeString(v)
		if err != nil {
			return nil, false, fmt.Errorf("field %q is not standard base64: %v", fieldPayloadBase64, err)
		}
		cols[4] = column{kind: 't', data: append([]byte(`\x`), hex.EncodeToString(bin)...)}
		base64Payload = true
	case hasPayload && !isNull(payload):
		cols[4] = column{kind: 't', data: payload}
	default:
		cols[4].kind = 'n'
	}
	if h, ok := fields["headers"]; ok && !isNull(h) {
		cols[5] = column{kind: 't', data: h}
	} else {
		cols[5].kind = 'n'
	}
	return cols, base64Payload, nil
}

func knownField(k string) bool {
	if k == fieldPayloadBase64 {
		return true
	}
	for _, f := range envelopeFields {
		if k == f {
			return true
		}
	}
	return false
}

func isNull(raw json.RawMessage) bool { return string(raw) == "null" }

// DecodeEnvelope builds the event of one outbox message content (the
// pg_logical_emit_message content) with exactly the rules Decode applies,
// at the position given; like RowDecoder.Decode, an invalid envelope is an
// *InvalidEventError, or a dead letter when Config.DeadLetterSubject is set.
func (c Config) DecodeEnvelope(content []byte, commitLSN pglogrepl.LSN, txIndex int) (Event, error) {
	prefix := c.MessagePrefix
	if prefix == "" {
		prefix = DefaultMessagePrefix
	}
	ev := Event{CommitLSN: commitLSN, TxIndex: txIndex, messagePrefix: prefix}
	if err := c.fillMessage(&ev, content); err != nil {
		err.LSN, err.TxIndex = commitLSN, txIndex
		if c.DeadLetterSubject == "" || !err.DeadLetterable() {
			return Event{}, err
		}
		return c.DeadLetter(&ev, err), nil
	}
	return ev, nil
}
