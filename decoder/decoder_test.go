package decoder

import (
	"encoding/binary"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jetbox-dev/jetbox/sink/format"

	"github.com/jackc/pglogrepl"
)

// pgoutput v1 message builders (see the protocol docs, "Logical Replication
// Message Formats").

func u16(b []byte, v uint16) []byte  { return binary.BigEndian.AppendUint16(b, v) }
func u32(b []byte, v uint32) []byte  { return binary.BigEndian.AppendUint32(b, v) }
func u64(b []byte, v uint64) []byte  { return binary.BigEndian.AppendUint64(b, v) }
func cstr(b []byte, s string) []byte { return append(append(b, s...), 0) }

var pgEpoch = time.Date(2000, 1, 1, 0, 0, 0, 0, time.UTC)

func beginMsg(final pglogrepl.LSN, at time.Time, xid uint32) []byte {
	b := []byte{'B'}
	b = u64(b, uint64(final))
	b = u64(b, uint64(at.Sub(pgEpoch).Microseconds()))
	return u32(b, xid)
}

func commitMsg(commit, end pglogrepl.LSN, at time.Time) []byte {
	b := []byte{'C', 0}
	b = u64(b, uint64(commit))
	b = u64(b, uint64(end))
	return u64(b, uint64(at.Sub(pgEpoch).Microseconds()))
}

type col struct {
	name string
	oid  uint32
}

func relationMsg(id uint32, schema, table string, cols []col) []byte {
	b := []byte{'R'}
	b = u32(b, id)
	b = cstr(b, schema)
	b = cstr(b, table)
	b = append(b, 'd')
	b = u16(b, uint16(len(cols)))
	for _, c := range cols {
		b = append(b, 0)
		b = cstr(b, c.name)
		b = u32(b, c.oid)
		b = u32(b, 0xffffffff)
	}
	return b
}

// insertMsg takes column values; nil is NULL.
func insertMsg(rel uint32, values ...*string) []byte {
	b := []byte{'I'}
	b = u32(b, rel)
	b = append(b, 'N')
	b = u16(b, uint16(len(values)))
	for _, v := range values {
		if v == nil {
			b = append(b, 'n')
			continue
		}
		b = append(b, 't')
		b = u32(b, uint32(len(*v)))
		b = append(b, *v...)
	}
	return b
}

func s(v string) *string { return &v }

var outboxCols = []col{
	{"id", oidUUID}, {"aggregate_type", oidText}, {"aggregate_id", oidText}, {"event_type", oidText},
	{"payload", oidJSONB}, {"headers", oidJSONB}, {"created_at", 1184},
}

func newTestDecoder() *Decoder {
	return New(Config{Schema: "public", Table: "outbox", Columns: DefaultColumns, SubjectPrefix: "outbox"})
}

func decode(t *testing.T, d *Decoder, msg []byte) Message {
	t.Helper()
	m, err := d.Decode(msg)
	if err != nil {
		t.Fatalf("Decode(%q...): %v", msg[0], err)
	}
	return m
}

const id1 = "0b5e8f8e-4f0b-4a34-9d0c-2a1c3e4f5a6b"

func TestDecodeTransaction(t *testing.T) {
	d := newTestDecoder()
	at := time.Date(2026, 12, 1, 10, 0, 0, 123456000, time.UTC)
	decode(t, d, relationMsg(16384, "public", "outbox", outboxCols))
	decode(t, d, relationMsg(16390, "public", "other", []col{{"id", 20}}))
	if m := decode(t, d, beginMsg(0x1000, at, 42)); m.Kind != KindBegin || !d.InTransaction() {
		t.Fatalf("begin: %+v", m)
	}
	m := decode(t, d, insertMsg(16384, s(id1), s("order"), s("o-1"), s("OrderCreated"), s(`{"a": 1}`), s(`{"traceparent": "00-1", "n": null}`), s("2026-12-01")))
	if m.Kind != KindEvent {
		t.Fatalf("insert: %+v", m)
	}
	ev := m.Event
	if ev.ID != id1 || ev.Subject != "outbox.order.OrderCreated" || string(ev.Payload) != `{"a": 1}` ||
		ev.AggregateID != "o-1" || ev.CommitLSN != 0x1000 || !ev.CommitTime.Equal(at) || ev.TxIndex != 0 || ev.XID != 42 {
		t.Fatalf("event: %+v", ev)
	}
	if len(ev.Headers) != 1 || ev.Headers[0] != (Header{"traceparent", "00-1"}) {
		t.Fatalf("headers: %+v", ev.Headers)
	}
	if m := decode(t, d, insertMsg(16390, s("7"))); m.Kind != KindNone {
		t.Fatalf("other table produced %+v", m)
	}
	m = decode(t, d, insertMsg(16384, s(id1), s("order"), s("o-1"), s("OrderPaid"), s(`{}`), nil, nil))
	if m.Event.TxIndex != 1 || m.Event.Headers != nil {
		t.Fatalf("second event: %+v", m.Event)
	}
	m = decode(t, d, commitMsg(0x1000, 0x1040, at))
	if m.Kind != KindCommit || m.EndLSN != 0x1040 || d.InTransaction() {
		t.Fatalf("commit: %+v", m)
	}
	// The next transaction numbers its rows from 0 again.
	decode(t, d, beginMsg(0x2000, at, 43))
	if m := decode(t, d, insertMsg(16384, s(id1), s("a"), s("b"), s("c"), s(`1`), nil, nil)); m.Event.TxIndex != 0 {
		t.Fatalf("tx index not reset: %d", m.Event.TxIndex)
	}
}

func TestDecodeIgnoresUpdatesDeletesAndMessages(t *testing.T) {
	d := newTestDecoder()
	for _, typ := range []byte{'U', 'D', 'T', 'Y', 'O', 'M'} {
		if m, err := d.Decode([]byte{typ, 1, 2, 3}); err != nil || m.Kind != KindNone {
			t.Errorf("%q: %+v %v", typ, m, err)
		}
	}
}

func TestDecodeBytea(t *testing.T) {
	d := New(Config{Schema: "app", Table: "events", SubjectPrefix: "p",
		Columns: Columns{ID: "event_id", AggregateType: "kind", AggregateID: "key", EventType: "name", Payload: "body"}})
	decode(t, d, relationMsg(1, "app", "events", []col{{"event_id", oidText}, {"kind", oidText}, {"key", oidVarchar}, {"name", oidText}, {"body", oidBytea}}))
	decode(t, d, beginMsg(10, time.Now(), 1))
	m := decode(t, d, insertMsg(1, s("e-1"), s("k"), s("x"), s("n"), s(`\x00ff0a`)))
	if string(m.Event.Payload) != "\x00\xff\x0a" || m.Event.ID != "e-1" || m.Event.Subject != "p.k.n" {
		t.Fatalf("%+v", m.Event)
	}
}

func TestInvalidRows(t *testing.T) {
	cases := []struct {
		name    string
		values  []*string
		wantID  string
		wantErr string
		code    string
	}{
		{"null id", []*string{nil, s("order"), s("1"), s("E"), s("{}"), nil, nil}, "", `column "id" is NULL`, format.ReasonBadID},
		{"null payload", []*string{s(id1), s("order"), s("1"), s("E"), nil, nil, nil}, id1, "payload is NULL", format.ReasonNullPayload},
		{"space in aggregate_type", []*string{s(id1), s("big order"), s("1"), s("E"), s("{}"), nil, nil}, id1, "aggregate_type", format.ReasonBadSubject},
		{"dot in event_type", []*string{s(id1), s("order"), s("1"), s("a.b"), s("{}"), nil, nil}, id1, "event_type", format.ReasonBadSubject},
		{"wildcard", []*string{s(id1), s("*"), s("1"), s("E"), s("{}"), nil, nil}, id1, "reserve", format.ReasonBadSubject},
		{"empty event_type", []*string{s(id1), s("order"), s("1"), s(""), s("{}"), nil, nil}, id1, "empty", format.ReasonBadSubject},
		{"control byte", []*string{s(id1), s("or\x01der"), s("1"), s("E"), s("{}"), nil, nil}, id1, "control", format.ReasonBadSubject},
		{"headers not an object", []*string{s(id1), s("order"), s("1"), s("E"), s("{}"), s(`[1]`), nil}, id1, "not a JSON object", format.ReasonBadHeaders},
		{"reserved header", []*string{s(id1), s("order"), s("1"), s("E"), s("{}"), s(`{"Nats-Msg-Id": "x"}`), nil}, id1, "reserved", format.ReasonBadHeaders},
		{"header with CRLF", []*string{s(id1), s("order"), s("1"), s("E"), s("{}"), s(`{"a": "x\r\nb: y"}`), nil}, id1, "control", format.ReasonBadHeaders},
		{"bad header name", []*string{s(id1), s("order"), s("1"), s("E"), s("{}"), s(`{"a b": "x"}`), nil}, id1, "header name", format.ReasonBadHeaders},
		// nats-server 2.10 finds its headers by text search (TestServerHeaderSearch in sink).
		{"header name holding Nats-", []*string{s(id1), s("order"), s("1"), s("E"), s("{}"), s(`{"X-Nats-Msg-Id": "x"}`), nil}, id1, "find their headers by text search", format.ReasonBadHeaders},
		{"header name holding Nats-Expected-", []*string{s(id1), s("order"), s("1"), s("E"), s("{}"), s(`{"trace-Nats-Expected-Last-Sequence": "1"}`), nil}, id1, "rename it", format.ReasonBadHeaders},
		{"id holding Nats-", []*string{s("a-Nats-Expected-Last-Sequence"), s("order"), s("1"), s("E"), s("{}"), nil, nil}, "", "find their own headers by text search", format.ReasonBadID},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			d := newTestDecoder()
			decode(t, d, relationMsg(5, "public", "outbox", outboxCols))
			decode(t, d, beginMsg(0xABC, time.Now(), 1))
			_, err := d.Decode(insertMsg(5, c.values...))
			var ie *InvalidEventError
			if !errors.As(err, &ie) {
				t.Fatalf("want *InvalidEventError, got %v", err)
			}
			if ie.ID != c.wantID || ie.LSN != 0xABC || !strings.Contains(ie.Error(), c.wantErr) {
				t.Fatalf("error %q (id %q, lsn %s), want id %q and %q", ie.Error(), ie.ID, ie.LSN, c.wantID, c.wantErr)
			}
			if !strings.Contains(ie.Error(), "0/ABC") {
				t.Fatalf("error does not name the LSN: %s", ie)
			}
			if ie.Code != c.code {
				t.Fatalf("code %q, want %q", ie.Code, c.code)
			}
			// With dead-lettering, the same row becomes a dead letter.
			dd := New(Config{Schema: "public", Table: "outbox", Columns: DefaultColumns, SubjectPrefix: "outbox", DeadLetterSubject: "outbox._dlq"})
			decode(t, dd, relationMsg(5, "public", "outbox", outboxCols))
			decode(t, dd, beginMsg(0xABC, time.Now(), 1))
			m := decode(t, dd, insertMsg(5, c.values...))
			dl := m.Event
			if m.Kind != KindEvent || dl.DeadLetter == nil || dl.Subject != "outbox._dlq."+c.code || dl.ID != "jetbox-dlq-0/ABC-0" {
				t.Fatalf("dead letter %+v", dl)
			}
			hs := map[string]string{}
			for _, h := range dl.Headers {
				hs[h.Key] = h.Value
				if !printable(h.Value) || validHeaderName(h.Key) != nil {
					t.Fatalf("unsafe dead-letter header %q", h)
				}
			}
			if hs[format.HeaderDeadLetterReason] != c.code || !strings.Contains(hs[format.HeaderDeadLetterError], c.wantErr) || hs[format.HeaderTable] != "public.outbox" {
				t.Fatalf("dead-letter headers %v", hs)
			}
			if c.values[4] != nil && string(dl.Payload) != *c.values[4] {
				t.Fatalf("payload %q not kept", dl.Payload)
			}
		})
	}
}

// TestTooLarge: a row over the message limit is invalid; its dead letter
// carries a reference instead of the payload.
func TestTooLarge(t *testing.T) {
	big := `{"pad":"` + strings.Repeat("x", 5000) + `"}`
	for _, dlq := range []string{"", "outbox._dlq"} {
		d := New(Config{Schema: "public", Table: "outbox", Columns: DefaultColumns, SubjectPrefix: "outbox", MaxMessageSize: 4096, DeadLetterSubject: dlq})
		decode(t, d, relationMsg(5, "public", "outbox", outboxCols))
		decode(t, d, beginMsg(0x10, time.Now(), 1))
		if m := decode(t, d, insertMsg(5, s(id1), s("order"), s("1"), s("E"), s(`{}`), nil, nil)); m.Event.DeadLetter != nil {
			t.Fatal("a small row was dead-lettered")
		}
		m, err := d.Decode(insertMsg(5, s(id1), s("order"), s("1"), s("E"), s(big), nil, nil))
		if dlq == "" {
			var ie *InvalidEventError
			if !errors.As(err, &ie) || ie.Code != format.ReasonTooLarge || ie.ID != id1 || !strings.Contains(err.Error(), "max_payload") {
				t.Fatalf("got %v", err)
			}
			continue
		}
		if err != nil {
			t.Fatal(err)
		}
		dl := m.Event
		if dl.Subject != "outbox._dlq.too-large" || !strings.Contains(string(dl.Payload), id1) || len(dl.Payload) > 1024 {
			t.Fatalf("dead letter %s %q", dl.Subject, dl.Payload)
		}
	}
}

// TestTableChangeIsNeverDeadLettered: rows of a table that lost its outbox
// columns stop jetbox even with dead-lettering on.
func TestTableChangeIsNeverDeadLettered(t *testing.T) {
	d := New(Config{Schema: "public", Table: "outbox", Columns: DefaultColumns, SubjectPrefix: "outbox", DeadLetterSubject: "outbox._dlq"})
	decode(t, d, relationMsg(5, "public", "outbox", outboxCols[1:]))
	decode(t, d, beginMsg(0x10, time.Now(), 1))
	_, err := d.Decode(insertMsg(5, s("order"), s("1"), s("E"), s(`{}`), nil, nil))
	var ie *InvalidEventError
	if !errors.As(err, &ie) || ie.Code != format.ReasonTableChanged || ie.DeadLetterable() {
		t.Fatalf("got %v", err)
	}
	// An aggregate type inside the dead-letter subjects is refused.
	decode(t, d, relationMsg(5, "public", "outbox", outboxCols))
	m := decode(t, d, insertMsg(5, s(id1), s("_dlq"), s("1"), s("E"), s(`{}`), nil, nil))
	if m.Event.DeadLetter == nil || m.Event.DeadLetter.Code != format.ReasonBadSubject {
		t.Fatalf("%+v", m.Event)
	}
}

func TestEscape(t *testing.T) {
	for in, want := range map[string]string{"plain": "plain", "a\r\nb": `a\r\nb`, "\x00": `\x00`, "é": "é", "\xff": `\xff`} {
		if got := escape(in, 64); got != want {
			t.Errorf("escape(%q) = %q, want %q", in, got, want)
		}
	}
	if got := escape(strings.Repeat("a", 100), 10); len(got) > 13 {
		t.Errorf("not truncated: %q", got)
	}
}

func TestRelationChanges(t *testing.T) {
	d := newTestDecoder()
	decode(t, d, relationMsg(5, "public", "outbox", outboxCols))
	decode(t, d, beginMsg(1, time.Now(), 1))
	// A column added and the columns reordered: still decoded by name.
	cols := []col{{"extra", oidText}, {"payload", oidJSON}, {"event_type", oidText}, {"aggregate_id", oidText}, {"aggregate_type", oidText}, {"id", oidUUID}}
	decode(t, d, relationMsg(5, "public", "outbox", cols))
	m := decode(t, d, insertMsg(5, s("x"), s(`{"k":1}`), s("E"), s("a1"), s("order"), s(id1)))
	if m.Event.ID != id1 || string(m.Event.Payload) != `{"k":1}` || m.Event.Subject != "outbox.order.E" {
		t.Fatalf("%+v", m.Event)
	}
	// The payload column dropped: the row cannot be published.
	decode(t, d, relationMsg(5, "public", "outbox", cols[2:]))
	_, err := d.Decode(insertMsg(5, s("E"), s("a1"), s("order"), s(id1)))
	var ie *InvalidEventError
	if !errors.As(err, &ie) || !strings.Contains(err.Error(), `column "payload" is missing`) {
		t.Fatalf("got %v", err)
	}
	// Retyped to an unsupported type.
	decode(t, d, relationMsg(5, "public", "outbox", []col{{"id", 20}, {"aggregate_type", oidText}, {"aggregate_id", oidText}, {"event_type", oidText}, {"payload", oidJSONB}}))
	if _, err := d.Decode(insertMsg(5, s("1"), s("a"), s("b"), s("c"), s("{}"))); err == nil || !strings.Contains(err.Error(), "want uuid or text") {
		t.Fatalf("got %v", err)
	}
}

func TestProtocolErrors(t *testing.T) {
	d := newTestDecoder()
	for name, msg := range map[string][]byte{
		"empty":               {},
		"short begin":         {'B', 1, 2},
		"short relation":      {'R', 0, 0},
		"unknown type":        {'Z'},
		"stream start":        {'S', 0, 0, 0, 1, 1},
		"insert before rel":   insertMsg(9, s("x")),
		"commit without tx":   commitMsg(1, 2, time.Now()),
		"truncated relation":  relationMsg(1, "public", "outbox", outboxCols)[:20],
		"two-phase prepare":   {'P', 0},
		"relation no columns": {'R', 0, 0, 0, 1, 'p', 0, 'o', 0, 'd'},
	} {
		if _, err := d.Decode(msg); !errors.Is(err, ErrProtocol) {
			t.Errorf("%s: got %v, want ErrProtocol", name, err)
		}
	}
	decode(t, d, relationMsg(5, "public", "outbox", outboxCols))
	decode(t, d, beginMsg(1, time.Now(), 1))
	full := insertMsg(5, s(id1), s("order"), s("1"), s("E"), s("{}"), nil, nil)
	for i := 1; i < len(full); i++ {
		if _, err := d.Decode(full[:i]); !errors.Is(err, ErrProtocol) {
			t.Fatalf("insert truncated to %d bytes: got %v", i, err)
		}
	}
	if _, err := d.Decode(beginMsg(2, time.Now(), 2)); !errors.Is(err, ErrProtocol) {
		t.Fatalf("nested BEGIN: %v", err)
	}
}

func TestSubject(t *testing.T) {
	good := [][3]string{{"outbox", "order", "OrderCreated"}, {"acme.outbox", "ordér", "Créé"}, {"o", "a-b_c", "E:1"}}
	for _, g := range good {
		if _, err := Subject(g[0], g[1], g[2]); err != nil {
			t.Errorf("%v: %v", g, err)
		}
	}
	bad := [][3]string{{"", "a", "b"}, {"a..b", "a", "b"}, {"a.", "a", "b"}, {"o", "", "b"}, {"o", "a b", "c"}, {"o", "a", "b\tc"},
		{"o", ">", "c"}, {"o", "a", "*"}, {"o", "a.b", "c"}, {"o", "a", "\x7f"}, {"o", "\xff", "c"}, {"o*", "a", "b"},
		// A value may not start a token with '_': <prefix>._jetbox is the
		// atomic probe's subject, <prefix>._dlq the dead letters'.
		{"o", "_jetbox", "c"}, {"o", "_dlq", "c"}, {"o", "a", "_x"}}
	for _, b := range bad {
		if _, err := Subject(b[0], b[1], b[2]); err == nil {
			t.Errorf("%q accepted", b)
		}
	}
}

func TestParseHeaders(t *testing.T) {
	h, err := parseHeaders([]byte(`{"b": "2", "a": "1", "z": null, "u": "\u00e9"}`))
	if err != nil {
		t.Fatal(err)
	}
	want := []Header{{"a", "1"}, {"b", "2"}, {"u", "é"}}
	if len(h) != len(want) {
		t.Fatalf("%+v", h)
	}
	for i := range want {
		if h[i] != want[i] {
			t.Fatalf("%+v, want %+v", h, want)
		}
	}
	for _, in := range []string{`{"n": 1}`, `{"o": {"x": "y"}}`, `{"a": [1]}`, `{"t": true}`, `[]`, `"x"`, `{"Nats-Msg-Id": "x"}`, `{"jetbox-source": "x"}`, `{"a b": "x"}`, `{"a": "x\r\nb"}`, `{"a": "see Nats-Msg-Id"}`, `{"X-Nats-Msg-Id": "x"}`, `{"a-Nats-Expected-Stream": "x"}`, `{`} {
		if _, err := parseHeaders([]byte(in)); err == nil {
			t.Errorf("%s accepted", in)
		}
	}
	// Other spellings do not fool the server's search: accepted.
	for _, in := range []string{`{"x-nats-msg-id": "x"}`, `{"X-NATS-MSG-ID": "nats-expected-last-sequence"}`} {
		if _, err := parseHeaders([]byte(in)); err != nil {
			t.Errorf("%s: %v", in, err)
		}
	}
	for _, in := range []string{"null", "", "{}", "  {} "} {
		if h, err := parseHeaders([]byte(in)); err != nil || h != nil {
			t.Errorf("%q: %v %v", in, h, err)
		}
	}
	for _, in := range []string{`"x"`, `[]`, `{"a":`, `{"jetbox-x": "1"}`, `{"NATS-EXPECTED-STREAM": "1"}`} {
		if _, err := parseHeaders([]byte(in)); err == nil {
			t.Errorf("%q accepted", in)
		}
	}
}

func BenchmarkDecodeInsert(b *testing.B) {
	d := newTestDecoder()
	if _, err := d.Decode(relationMsg(5, "public", "outbox", outboxCols)); err != nil {
		b.Fatal(err)
	}
	if _, err := d.Decode(beginMsg(1, time.Now(), 1)); err != nil {
		b.Fatal(err)
	}
	msg := insertMsg(5, s(id1), s("order"), s("o-123"), s("OrderCreated"),
		s(`{"order_id": 123, "customer": "c-42", "items": [{"sku": "A", "qty": 2}], "total": 99.5}`), nil, s("2026-12-01 10:00:00+00"))
	b.ReportAllocs()
	b.SetBytes(int64(len(msg)))
	for i := 0; i < b.N; i++ {
		if _, err := d.Decode(msg); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkDecodeInsertWithHeaders(b *testing.B) {
	d := newTestDecoder()
	_, _ = d.Decode(relationMsg(5, "public", "outbox", outboxCols))
	_, _ = d.Decode(beginMsg(1, time.Now(), 1))
	msg := insertMsg(5, s(id1), s("order"), s("o-123"), s("OrderCreated"), s(`{"order_id": 123}`),
		s(`{"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}`), nil)
	b.ReportAllocs()
	for i := 0; i < b.N; i++ {
		if _, err := d.Decode(msg); err != nil {
			b.Fatal(err)
		}
	}
}

// TestTableReplaced: a Relation message for the outbox with another OID than
// the table's at start, in a transaction committed after the OID was read,
// is ErrTableReplaced; older transactions (an older table's rows) and other
// tables pass.
func TestTableReplaced(t *testing.T) {
	d := newTestDecoder()
	d.SetOutbox(OutboxIdentity{OID: 5, LSN: 0x100})
	decode(t, d, beginMsg(0x80, time.Now(), 1))
	decode(t, d, relationMsg(4, "public", "outbox", outboxCols)) // history: before the OID was read
	decode(t, d, commitMsg(0x80, 0x90, time.Now()))
	decode(t, d, beginMsg(0x200, time.Now(), 2))
	decode(t, d, relationMsg(5, "public", "outbox", outboxCols))
	decode(t, d, relationMsg(9, "public", "other", outboxCols))
	decode(t, d, commitMsg(0x200, 0x210, time.Now()))
	decode(t, d, beginMsg(0x300, time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC), 3))
	_, err := d.Decode(relationMsg(7, "public", "outbox", outboxCols))
	if !errors.Is(err, ErrTableReplaced) || !strings.Contains(err.Error(), "relation OID 5 when jetbox started, 7 in transaction 0/300") ||
		!strings.Contains(err.Error(), "committed before 2026-01-02T03:04:05Z") {
		t.Fatalf("got %v", err)
	}
	// Without an identity nothing is checked.
	d = newTestDecoder()
	decode(t, d, beginMsg(0x300, time.Now(), 3))
	decode(t, d, relationMsg(7, "public", "outbox", outboxCols))
}

// TestSubjectsPerEvent: the subject cache (per aggregate and event type)
// serves the historical subjects only; a template holding the aggregate id
// renders every event's own, and a bad value is refused on every row, not
// only on the first.
func TestSubjectsPerEvent(t *testing.T) {
	tpl, err := ParseTemplate("{prefix}.{aggregate_type}.{aggregate_id}.{event_type}", 0)
	if err != nil {
		t.Fatal(err)
	}
	at := time.Date(2026, 12, 1, 10, 0, 0, 0, time.UTC)
	for _, c := range []struct {
		subjects *Template
		want     []string
	}{
		{nil, []string{"outbox.order.OrderCreated", "outbox.order.OrderCreated"}},
		{tpl, []string{"outbox.order.o-1.OrderCreated", "outbox.order.o-2.OrderCreated"}},
	} {
		d := New(Config{Schema: "public", Table: "outbox", Columns: DefaultColumns, SubjectPrefix: "outbox", Subjects: c.subjects})
		decode(t, d, relationMsg(16384, "public", "outbox", outboxCols))
		decode(t, d, beginMsg(0x1000, at, 42))
		for i, agg := range []string{"o-1", "o-2"} {
			m := decode(t, d, insertMsg(16384, s(id1), s("order"), s(agg), s("OrderCreated"), s(`{}`), nil, nil))
			if m.Event.Subject != c.want[i] || m.Event.DeadLetter != nil {
				t.Errorf("template %v, row %d: subject %q, want %q", c.subjects, i, m.Event.Subject, c.want[i])
			}
		}
		for i := 0; i < 2; i++ {
			if _, err := d.Decode(insertMsg(16384, s(id1), s("bad type"), s("o-1"), s("OrderCreated"), s(`{}`), nil, nil)); err == nil {
				t.Errorf("template %v: row %d with a bad aggregate_type accepted", c.subjects, i)
			}
		}
	}
}

// TestPartitionRows: with the outbox's partitions set, the inserts of a
// Relation message named after a partition (a publication without
// publish_via_partition_root) are outbox rows, numbered with the outbox's
// in one transaction, whatever the partition's column order; the first row
// of each such relation names the partition. A table the decoder does not
// know is looked up once per Relation message; a lookup error fails the
// Decode; other tables stay ignored. A partition's OID is never taken for a
// replaced outbox.
func TestPartitionRows(t *testing.T) {
	d := newTestDecoder()
	d.SetOutbox(OutboxIdentity{OID: 5, LSN: 0x100})
	var asked []uint32
	lookupErr := errors.New("connection refused")
	d.SetPartitions([]uint32{11}, func(oid uint32, name string) (bool, error) {
		asked = append(asked, oid)
		switch oid {
		case 12:
			return name == "public.outbox_new", nil
		case 13:
			return false, lookupErr
		}
		return false, nil
	})
	decode(t, d, beginMsg(0x200, time.Now(), 2))
	// pgoutput describes the leaves with publish_via_partition_root too.
	decode(t, d, relationMsg(5, "public", "outbox", outboxCols))
	decode(t, d, relationMsg(11, "public", "outbox_all", outboxCols))
	reordered := append([]col{outboxCols[6], outboxCols[3]}, outboxCols[0], outboxCols[1], outboxCols[2], outboxCols[4], outboxCols[5])
	decode(t, d, relationMsg(12, "public", "outbox_new", reordered))
	decode(t, d, relationMsg(9, "public", "other", outboxCols))
	decode(t, d, relationMsg(10, "public", "notes", outboxCols[:2]))
	for i, c := range []struct {
		rel       uint32
		kind      Kind
		partition string
	}{{5, KindEvent, ""}, {11, KindEvent, "public.outbox_all"}, {10, KindNone, ""}, {11, KindEvent, ""}, {5, KindEvent, ""}} {
		m := decode(t, d, insertMsg(c.rel, s(id1), s("order"), s("o-1"), s("E"), s(`{}`), nil, nil))
		if m.Kind != c.kind || m.Partition != c.partition || c.kind == KindEvent && m.Event.Subject != "outbox.order.E" {
			t.Fatalf("row %d of relation %d: %+v", i, c.rel, m)
		}
	}
	// A table with the outbox's columns the catalog does not place under
	// it may have been a partition when the row was written: a stop.
	if _, err := d.Decode(insertMsg(9, s(id1), s("order"), s("o-1"), s("E"), s(`{}`), nil, nil)); !errors.Is(err, ErrUnplacedTable) || !strings.Contains(err.Error(), "public.other") {
		t.Fatalf("row of an unplaced table with the outbox's columns: %v", err)
	}
	m := decode(t, d, insertMsg(12, s("2026-01-01"), s("Moved"), s(id1), s("order"), s("o-1"), s(`{}`), nil))
	if m.Kind != KindEvent || m.Event.EventType != "Moved" || m.Event.AggregateID != "o-1" || m.Event.TxIndex != 4 || m.Partition != "public.outbox_new" {
		t.Fatalf("row of the attached partition: %+v", m)
	}
	if _, err := d.Decode(relationMsg(13, "public", "outbox_x", outboxCols)); !errors.Is(err, lookupErr) || !strings.Contains(err.Error(), "public.outbox_x") {
		t.Fatalf("lookup error: %v", err)
	}
	if !slices.Equal(asked, []uint32{12, 9, 10, 13}) {
		t.Fatalf("looked up %v, want 12, 9, 10, 13 (11 is known, 5 is the outbox)", asked)
	}
}
