package decoder

import (
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jetbox-dev/jetbox/sink/format"

	"github.com/jackc/pglogrepl"
)

// logicalMsg builds a pgoutput Message ('M') as pg_logical_emit_message
// produces it.
func logicalMsg(transactional bool, lsn pglogrepl.LSN, prefix, content string) []byte {
	b := []byte{'M', 0}
	if transactional {
		b[1] = 1
	}
	b = u64(b, uint64(lsn))
	b = cstr(b, prefix)
	b = u32(b, uint32(len(content)))
	return append(b, content...)
}

func newMixedDecoder(dlq string) *Decoder {
	return New(Config{Schema: "public", Table: "outbox", Columns: DefaultColumns, SubjectPrefix: "outbox",
		MessagePrefix: DefaultMessagePrefix, DeadLetterSubject: dlq})
}

const env1 = `{"id": "` + id1 + `", "aggregate_type": "order", "aggregate_id": "o-1", "event_type": "OrderPaid", "payload": {"a": 1}, "headers": {"traceparent": "00-1"}}`

// A message becomes exactly the event a row with the same values becomes,
// and rows and messages share Jetbox-Tx-Index.
func TestDecodeMessageLikeRow(t *testing.T) {
	at := time.Date(2026, 12, 1, 10, 0, 0, 0, time.UTC)
	d := newMixedDecoder("")
	decode(t, d, relationMsg(16384, "public", "outbox", outboxCols))
	decode(t, d, beginMsg(0x1000, at, 42))
	row := decode(t, d, insertMsg(16384, s(id1), s("order"), s("o-1"), s("OrderPaid"), s(`{"a": 1}`), s(`{"traceparent": "00-1"}`), nil))
	msg := decode(t, d, logicalMsg(true, 0x0f00, "jetbox", env1))
	if msg.Kind != KindEvent || row.Kind != KindEvent {
		t.Fatalf("kinds %v %v", row.Kind, msg.Kind)
	}
	if msg.Event.TxIndex != 1 {
		t.Fatalf("message tx index %d, want 1 (rows and messages count together)", msg.Event.TxIndex)
	}
	a, b := row.Event, msg.Event
	a.TxIndex, b.TxIndex, b.messagePrefix = 0, 0, ""
	if aj, bj := mustJSON(t, a), mustJSON(t, b); aj != bj {
		t.Fatalf("row and message differ:\nrow %s\nmsg %s", aj, bj)
	}
	if r := decode(t, d, insertMsg(16384, s(id1), s("order"), s("o-1"), s("E"), s(`{}`), nil, nil)); r.Event.TxIndex != 2 {
		t.Fatalf("row after message: tx index %d", r.Event.TxIndex)
	}
	if m := decode(t, d, commitMsg(0x1000, 0x1040, at)); m.Kind != KindCommit {
		t.Fatalf("commit %+v", m)
	}
}

func mustJSON(t *testing.T, v any) string {
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func TestDecodeMessageBase64Payload(t *testing.T) {
	d := newMixedDecoder("")
	decode(t, d, beginMsg(1, time.Now(), 1))
	m := decode(t, d, logicalMsg(true, 1, "jetbox", `{"id":"x1","aggregate_type":"a","aggregate_id":"1","event_type":"e","payload_base64":"AP8K"}`))
	if string(m.Event.Payload) != "\x00\xff\x0a" || m.Event.Subject != "outbox.a.e" {
		t.Fatalf("%+v", m.Event)
	}
}

func TestIgnoredMessages(t *testing.T) {
	d := newMixedDecoder("")
	decode(t, d, beginMsg(1, time.Now(), 1))
	for _, c := range []struct {
		name string
		msg  []byte
		want string
	}{
		{"other prefix", logicalMsg(true, 1, "other", env1), IgnoredOtherPrefix},
		{"prefix of the prefix", logicalMsg(true, 1, "jetbo", env1), IgnoredOtherPrefix},
		{"longer prefix", logicalMsg(true, 1, "jetbox2", env1), IgnoredOtherPrefix},
		{"non-transactional", logicalMsg(false, 1, "jetbox", env1), IgnoredNonTransactional},
		{"heartbeat", logicalMsg(false, 1, HeartbeatPrefix, ""), IgnoredHeartbeat},
	} {
		m := decode(t, d, c.msg)
		if m.Kind != KindNone || m.Ignored != c.want {
			t.Errorf("%s: %+v, want ignored %q", c.name, m, c.want)
		}
	}
	// Ignored messages take no index.
	if m := decode(t, d, logicalMsg(true, 1, "jetbox", env1)); m.Event.TxIndex != 0 {
		t.Fatalf("tx index %d after ignored messages", m.Event.TxIndex)
	}
	// Outside a transaction: a heartbeat is fine, a transactional message is a protocol error.
	decode(t, d, commitMsg(1, 2, time.Now()))
	if m := decode(t, d, logicalMsg(false, 3, HeartbeatPrefix, "")); m.Ignored != IgnoredHeartbeat {
		t.Fatalf("%+v", m)
	}
	if _, err := d.Decode(logicalMsg(true, 3, "jetbox", env1)); !errors.Is(err, ErrProtocol) {
		t.Fatalf("transactional message outside a transaction: %v", err)
	}
	// Messages off (source=table): nothing is even parsed.
	if m, err := newTestDecoder().Decode(logicalMsg(true, 1, "jetbox", env1)); err != nil || m.Kind != KindNone || m.Ignored != "" {
		t.Fatalf("messages off: %+v %v", m, err)
	}
}

func TestInvalidEnvelopes(t *testing.T) {
	base := map[string]any{"id": id1, "aggregate_type": "order", "aggregate_id": "o-1", "event_type": "E", "payload": map[string]any{}}
	with := func(k string, v any) string {
		m := map[string]any{}
		for k, v := range base {
			m[k] = v
		}
		if v == nil {
			delete(m, k)
		} else {
			m[k] = v
		}
		b, _ := json.Marshal(m)
		return string(b)
	}
	cases := []struct{ name, content, code string }{
		{"not json", `{"id":`, format.ReasonBadEnvelope},
		{"array", `[1]`, format.ReasonBadEnvelope},
		{"empty", ``, format.ReasonBadEnvelope},
		{"trailing text", with("id", id1) + " x", format.ReasonBadEnvelope},
		{"two objects", with("id", id1) + "{}", format.ReasonBadEnvelope},
		{"bad utf8", "{\"id\":\"\xff\"}", format.ReasonBadEnvelope},
		{"unknown field", with("event-type", "E"), format.ReasonBadEnvelope},
		{"duplicate field", `{"id":"a","id":"b","aggregate_type":"o","aggregate_id":"1","event_type":"E","payload":1}`, format.ReasonBadEnvelope},
		{"numeric type", with("aggregate_type", 5), format.ReasonBadEnvelope},
		{"object id", with("id", map[string]any{}), format.ReasonBadEnvelope},
		{"both payloads", with("payload_base64", "AA=="), format.ReasonBadEnvelope},
		{"base64 not a string", strings.Replace(with("payload", nil), `{`, `{"payload_base64":1,`, 1), format.ReasonBadEnvelope},
		{"bad base64", strings.Replace(with("payload", nil), `{`, `{"payload_base64":"!!",`, 1), format.ReasonBadEnvelope},
		{"no id", with("id", nil), format.ReasonBadID},
		{"empty id", with("id", ""), format.ReasonBadID},
		{"Nats- id", with("id", "x-Nats-Msg-Id"), format.ReasonBadID},
		{"no aggregate_type", with("aggregate_type", nil), format.ReasonNullColumn},
		{"no event_type", with("event_type", nil), format.ReasonNullColumn},
		{"aggregate_id control", with("aggregate_id", "a\nb"), format.ReasonBadAggregateID},
		{"dotted type", with("aggregate_type", "a.b"), format.ReasonBadSubject},
		{"wildcard event", with("event_type", "*"), format.ReasonBadSubject},
		{"no payload", with("payload", nil), format.ReasonNullPayload},
		{"null payload", strings.Replace(with("payload", nil), `{`, `{"payload":null,`, 1), format.ReasonNullPayload},
		{"headers array", with("headers", []any{1}), format.ReasonBadHeaders},
		{"headers number value", with("headers", map[string]any{"a": 1}), format.ReasonBadHeaders},
		{"reserved header", with("headers", map[string]any{"Nats-Msg-Id": "x"}), format.ReasonBadHeaders},
		{"too large", with("payload", strings.Repeat("x", 2000)), format.ReasonTooLarge},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			d := newMixedDecoder("")
			d.cfg.MaxMessageSize = 1500
			decode(t, d, beginMsg(0x1000, time.Now(), 1))
			_, err := d.Decode(logicalMsg(true, 0x0f00, "jetbox", c.content))
			var ie *InvalidEventError
			if !errors.As(err, &ie) || ie.Code != c.code || !ie.Message || ie.LSN != 0x1000 {
				t.Fatalf("err %v (%+v), want code %s", err, ie, c.code)
			}
			if !strings.HasPrefix(ie.Error(), "outbox message ") {
				t.Fatalf("error %q does not say it is a message", ie.Error())
			}
			// Dead-lettering instead: the dead letter keeps what could be read.
			d = newMixedDecoder("outbox._dlq")
			d.cfg.MaxMessageSize = 1500
			decode(t, d, beginMsg(0x1000, time.Now(), 1))
			m := decode(t, d, logicalMsg(true, 0x0f00, "jetbox", c.content))
			ev := m.Event
			if m.Kind != KindEvent || ev.DeadLetter == nil || ev.Subject != "outbox._dlq."+c.code || ev.ID != "jetbox-dlq-0/1000-0" {
				t.Fatalf("dead letter %+v", ev)
			}
			if h := header(ev, format.HeaderMessagePrefix); h != "jetbox" || header(ev, format.HeaderTable) != "" {
				t.Fatalf("dead letter source headers %+v", ev.Headers)
			}
			if c.code == format.ReasonBadEnvelope && string(ev.Payload) != c.content {
				t.Fatalf("bad envelope dead letter payload %q, want the content", ev.Payload)
			}
		})
	}
}

func header(ev Event, k string) string {
	for _, h := range ev.Headers {
		if h.Key == k {
			return h.Value
		}
	}
	return ""
}

// A malformed 'M' message (not its content) is a protocol error.
func TestMalformedLogicalMessage(t *testing.T) {
	d := newMixedDecoder("")
	decode(t, d, beginMsg(1, time.Now(), 1))
	full := logicalMsg(true, 1, "jetbox", env1)
	for _, msg := range [][]byte{full[:5], full[:20], append(full[:14:14], 0xff, 0xff, 0xff, 0xff), {'M', 1, 0, 0, 0, 0, 0, 0, 0, 1, 'j', 'e', 't', 'b', 'o', 'x'}} {
		if _, err := d.Decode(msg); !errors.Is(err, ErrProtocol) {
			t.Errorf("%q: %v", msg, err)
		}
	}
}

func TestDecodeEnvelopeMatchesDecode(t *testing.T) {
	cfg := Config{SubjectPrefix: "outbox", MessagePrefix: "jetbox", DeadLetterSubject: "outbox._dlq"}
	ev, err := cfg.DecodeEnvelope([]byte(env1), 0x1000, 3)
	if err != nil || ev.Subject != "outbox.order.OrderPaid" || ev.TxIndex != 3 || string(ev.Payload) != `{"a": 1}` {
		t.Fatalf("%+v %v", ev, err)
	}
	dl, err := cfg.DecodeEnvelope([]byte(`{`), 0x1000, 3)
	if err != nil || dl.Subject != "outbox._dlq.bad-envelope" {
		t.Fatalf("%+v %v", dl, err)
	}
}

func TestIndexScheme(t *testing.T) {
	for _, c := range []struct {
		cfg  Config
		want string
	}{
		{Config{Schema: "public", Table: "outbox"}, ""}, // --source=table: no header, messages unchanged
		{Config{Schema: "public", Table: "outbox", MessagePrefix: "jetbox"}, "table,messages:jetbox"},
		{Config{MessagePrefix: "jetbox"}, "messages:jetbox"},
		{Config{MessagePrefix: "acme"}, "messages:acme"},
	} {
		if got := c.cfg.IndexScheme(); got != c.want {
			t.Errorf("%+v: IndexScheme() = %q, want %q", c.cfg, got, c.want)
		}
	}
}
