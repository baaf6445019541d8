package decoder

import (
	"encoding/binary"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jetbox-dev/jetbox/sink/format"
)

// FuzzDecode feeds arbitrary bytes after a valid relation and BEGIN: every
// input must give an event, nothing, or an error; never a panic or a hang.
func FuzzDecode(f *testing.F) {
	at := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	seeds := [][]byte{
		relationMsg(5, "public", "outbox", outboxCols),
		beginMsg(0x1000, at, 7),
		insertMsg(5, s(id1), s("order"), s("o-1"), s("OrderCreated"), s(`{"a":1}`), s(`{"traceparent":"x"}`), nil),
		insertMsg(5, nil, nil, nil, nil, nil, nil, nil),
		insertMsg(5, s("a-Nats-Msg-Id"), s("order"), s("o-1"), s("E"), s(`{}`), s(`{"X-Nats-Expected-Last-Sequence":"1"}`), nil),
		commitMsg(0x1000, 0x1040, at),
		logicalMsg(true, 0x0f00, "jetbox", env1),
		logicalMsg(true, 0x0f00, "jetbox", `{"id":"m","aggregate_type":"a","aggregate_id":"1","event_type":"e","payload_base64":"AP8="}`),
		logicalMsg(false, 0x0f00, "jetbox", env1),
		logicalMsg(false, 0x0f00, HeartbeatPrefix, ""),
		logicalMsg(true, 0x0f00, "jetbox", `{"id":`),
		{'M', 1, 0, 0, 0, 0, 0, 0, 0, 1, 'j', 0, 0xff, 0xff, 0xff, 0xff},
		{'U', 0, 0, 0, 5, 'N', 0, 0},
		{'I', 0, 0, 0, 5, 'N', 0xff, 0xff},
		{},
	}
	for _, seed := range seeds {
		f.Add(seed)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		d := newTestDecoder()
		d.cfg.MessagePrefix = DefaultMessagePrefix
		if _, err := d.Decode(relationMsg(5, "public", "outbox", outboxCols)); err != nil {
			t.Fatal(err)
		}
		if _, err := d.Decode(beginMsg(1, at, 1)); err != nil {
			t.Fatal(err)
		}
		m, err := d.Decode(data)
		if err != nil {
			var ie *InvalidEventError
			if !errors.Is(err, ErrProtocol) && !errors.As(err, &ie) {
				t.Fatalf("unclassified error %T: %v", err, err)
			}
			return
		}
		if m.Kind == KindEvent {
			if _, serr := Subject("outbox", m.Event.AggregateType, m.Event.EventType); serr != nil || m.Event.ID == "" || mentionsNATSHeader(m.Event.ID) {
				t.Fatalf("invalid event accepted: %+v", m.Event)
			}
		}
	})
}

// FuzzParseHeaders: arbitrary header column text never panics, and what it
// accepts is safe to put on the wire.
func FuzzParseHeaders(f *testing.F) {
	for _, seed := range []string{`{"traceparent":"00-1"}`, `{"a":1,"b":"x"}`, `null`, `{"Nats-Msg-Id":"x"}`, `{"a":"\r\n"}`, `[]`, `{"X-Nats-Msg-Id":"x"}`, `{"x-nats-msg-id":"Nats-"}`} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		hs, err := parseHeaders(data)
		if err != nil {
			return
		}
		for _, h := range hs {
			if validHeaderName(h.Key) != nil || reservedHeader(h.Key) || !printable(h.Value) || mentionsNATSHeader(h.Key) || mentionsNATSHeader(h.Value) {
				t.Fatalf("unsafe header accepted: %q", h)
			}
		}
	})
}

// FuzzSubject: accepted subjects have exactly the expected tokens, none empty
// or wild.
func FuzzSubject(f *testing.F) {
	f.Add("outbox", "order", "OrderCreated")
	f.Add("a.b", "c d", "*")
	f.Add("outbox", "_jetbox", "atomic")
	f.Add("outbox", "order", "_dlq")
	f.Fuzz(func(t *testing.T, prefix, agg, ev string) {
		subj, err := Subject(prefix, agg, ev)
		if err != nil {
			return
		}
		if subj != prefix+"."+agg+"."+ev {
			t.Fatalf("subject %q", subj)
		}
		for _, tok := range splitDots(subj) {
			if tok == "" || tok == "*" || tok == ">" {
				t.Fatalf("bad token in %q", subj)
			}
		}
		if strings.HasPrefix(agg, "_") || strings.HasPrefix(ev, "_") {
			t.Fatalf("%q: a row value starts a token with '_' (jetbox's own subjects)", subj)
		}
	})
}

func splitDots(s string) []string { return strings.Split(s, ".") }

// FuzzDecodeStream decodes a whole session (length-framed messages, see
// joinMessages; the seeds are real pgoutput traffic) with one decoder:
// relation changes, transactions and inserts in any order and any shape
// yield events, nothing or errors; never a panic. Every event it returns is
// publishable; with dead-lettering on, no outbox row is ever dropped.
func FuzzDecodeStream(f *testing.F) {
	f.Add(joinMessages([][]byte{relationMsg(5, "public", "outbox", outboxCols), beginMsg(1, time.Unix(0, 0), 1),
		insertMsg(5, s(id1), s("order"), s("o-1"), s("E"), s(`{}`), nil, nil), commitMsg(1, 2, time.Unix(0, 0))}))
	// Rows and messages mixed in one transaction.
	f.Add(joinMessages([][]byte{relationMsg(5, "public", "outbox", outboxCols), beginMsg(1, time.Unix(0, 0), 1),
		insertMsg(5, s(id1), s("order"), s("o-1"), s("E"), s(`{}`), nil, nil), logicalMsg(true, 1, "jetbox", env1),
		logicalMsg(true, 1, "other", "x"), logicalMsg(true, 1, "jetbox", `[]`), commitMsg(1, 2, time.Unix(0, 0)),
		logicalMsg(false, 3, HeartbeatPrefix, "")}))
	// The outbox recreated under its name: a Relation message with a new OID.
	f.Add(joinMessages([][]byte{beginMsg(2, time.Unix(0, 0), 2), relationMsg(6, "public", "outbox", outboxCols),
		insertMsg(6, s(id1), s("order"), s("o-1"), s("E"), s(`{}`), nil, nil), commitMsg(2, 3, time.Unix(0, 0))}))
	f.Fuzz(func(t *testing.T, data []byte) {
		for _, dlq := range []string{"", "outbox._dlq"} {
			d := New(Config{Schema: "public", Table: "outbox", Columns: DefaultColumns, SubjectPrefix: "outbox", DeadLetterSubject: dlq, MaxMessageSize: 1 << 20, MessagePrefix: DefaultMessagePrefix})
			if dlq == "" {
				// The synthetic seeds' relation id (the captured ones have others:
				// the dead-letter pass decodes them whole).
				d.SetOutbox(OutboxIdentity{OID: 5, LSN: 1})
			}
			rest := data
			for len(rest) >= 4 {
				n := int(binary.BigEndian.Uint32(rest))
				rest = rest[4:]
				if n > len(rest) {
					n = len(rest)
				}
				msg := rest[:n]
				rest = rest[n:]
				m, err := d.Decode(msg)
				if errors.Is(err, ErrTableReplaced) {
					break // the forwarder stops on it
				}
				if err != nil {
					var ie *InvalidEventError
					if !errors.Is(err, ErrProtocol) && !errors.As(err, &ie) {
						t.Fatalf("unclassified error %T: %v", err, err)
					}
					if ie != nil && dlq != "" && ie.DeadLetterable() {
						t.Fatalf("dead-letterable row returned as an error: %v", err)
					}
					if errors.Is(err, ErrProtocol) {
						break // the forwarder stops on a protocol error
					}
					continue
				}
				if m.Kind != KindEvent {
					continue
				}
				ev := m.Event
				if ev.DeadLetter != nil {
					if !strings.HasPrefix(ev.Subject, dlq+".") || !strings.HasPrefix(ev.ID, "jetbox-dlq-") {
						t.Fatalf("dead letter %+v", ev)
					}
				} else if _, serr := Subject("outbox", ev.AggregateType, ev.EventType); serr != nil || ev.ID == "" || !printable(ev.ID) || !printable(ev.AggregateID) || mentionsNATSHeader(ev.ID) {
					t.Fatalf("invalid event accepted: %+v", ev)
				}
				for _, h := range ev.Headers {
					if validHeaderName(h.Key) != nil || !printable(h.Value) || mentionsNATSHeader(h.Key) || mentionsNATSHeader(h.Value) {
						t.Fatalf("unsafe header %q", h)
					}
				}
			}
		}
	})
}

// FuzzEnvelope: any message content gives an event or an invalid-row error
// (with dead-lettering on, always an event); what it accepts is publishable
// under the template, and a dead letter never loses the content it could
// not read.
func FuzzEnvelope(f *testing.F) {
	for _, seed := range []string{
		env1, `{}`, `null`, `[]`, `{"id":"a","id":"b"}`, `{"payload":1,"payload_base64":"AA=="}`,
		`{"id":"m","aggregate_type":"a","aggregate_id":"1","event_type":"e","payload_base64":"AP8="}`,
		`{"id":"m","aggregate_type":"a","aggregate_id":"1.2","event_type":"e","payload":null}`,
		`{"id":"m","aggregate_type":"a","aggregate_id":"1","event_type":"e","payload":"x","headers":{"Nats-Msg-Id":"1"}}`,
		`{"id":"m","aggregate_type":"a","aggregate_id":"1","event_type":"e","payload":{"a":[1,2,{"b":null}]}} `,
		"{\"id\":\"\xff\"}",
	} {
		f.Add([]byte(seed))
	}
	tpl, err := ParseTemplate("{prefix}.{aggregate_type}.{aggregate_id}.{partition}.{event_type}", 8)
	if err != nil {
		f.Fatal(err)
	}
	f.Fuzz(func(t *testing.T, content []byte) {
		for _, dlq := range []string{"", "outbox._dlq"} {
			for _, subjects := range []*Template{nil, tpl} {
				cfg := Config{SubjectPrefix: "outbox", MessagePrefix: "jetbox", DeadLetterSubject: dlq, MaxMessageSize: 1 << 16, Subjects: subjects}
				ev, err := cfg.DecodeEnvelope(content, 0x10, 1)
				if err != nil {
					var ie *InvalidEventError
					if !errors.As(err, &ie) || !ie.Message || dlq != "" {
						t.Fatalf("error %T %v (dead letters %q)", err, err, dlq)
					}
					continue
				}
				if ev.DeadLetter != nil {
					if dlq == "" || ev.Subject != dlq+"."+ev.DeadLetter.Code {
						t.Fatalf("dead letter %+v", ev)
					}
					if ev.DeadLetter.Code == format.ReasonBadEnvelope && string(ev.Payload) != string(content) {
						t.Fatalf("bad envelope dead letter lost the content")
					}
					continue
				}
				if ev.ID == "" || !printable(ev.ID) || mentionsNATSHeader(ev.ID) || !printable(ev.AggregateID) {
					t.Fatalf("invalid event accepted: %+v", ev)
				}
				toks := splitDots(ev.Subject)
				want := 3
				if subjects != nil {
					want = 5
				}
				if len(toks) != want || toks[0] != "outbox" || toks[1] != ev.AggregateType || toks[len(toks)-1] != ev.EventType {
					t.Fatalf("subject %q for %+v", ev.Subject, ev)
				}
				for _, tok := range toks {
					if validToken(tok) != nil {
						t.Fatalf("bad token in %q", ev.Subject)
					}
				}
				for _, h := range ev.Headers {
					if validHeaderName(h.Key) != nil || reservedHeader(h.Key) || !printable(h.Value) || mentionsNATSHeader(h.Key) || mentionsNATSHeader(h.Value) {
						t.Fatalf("unsafe header %q", h)
					}
				}
			}
		}
	})
}

// FuzzTemplate: a template that parses renders only subjects its Filter
// matches, made of valid tokens.
func FuzzTemplate(f *testing.F) {
	f.Add("{prefix}.{aggregate_type}.{event_type}", 0, "order", "o-1", "E")
	f.Add("{prefix}.x{partition}y.{aggregate_id}", 3, "order", "o-1", "E")
	f.Add("{prefix}.{aggregate_type}{event_type}", 0, "a", "b", "c")
	f.Add("{prefix}.{a", 0, "a", "b", "c")
	f.Fuzz(func(t *testing.T, text string, n int, aggType, aggID, evType string) {
		tpl, err := ParseTemplate(text, n%1000)
		if err != nil {
			return
		}
		subj, err := tpl.Render("outbox", &Event{AggregateType: aggType, AggregateID: aggID, EventType: evType})
		if err != nil {
			return
		}
		filter := splitDots(tpl.Filter("outbox"))
		toks := splitDots(subj)
		if len(toks) != len(filter) {
			t.Fatalf("subject %q, filter %v", subj, filter)
		}
		for i, tok := range toks {
			if validToken(tok) != nil || (filter[i] != "*" && filter[i] != tok) {
				t.Fatalf("subject %q, filter %v", subj, filter)
			}
		}
	})
}
