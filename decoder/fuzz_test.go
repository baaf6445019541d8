package decoder

import (
	"errors"
	"strings"
	"testing"
	"time"
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
		commitMsg(0x1000, 0x1040, at),
		{'U', 0, 0, 0, 5, 'N', 0, 0},
		{'I', 0, 0, 0, 5, 'N', 0xff, 0xff},
		{},
	}
	for _, seed := range seeds {
		f.Add(seed)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		d := newTestDecoder()
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
			if _, serr := Subject("outbox", m.Event.AggregateType, m.Event.EventType); serr != nil || m.Event.ID == "" {
				t.Fatalf("invalid event accepted: %+v", m.Event)
			}
		}
	})
}

// FuzzParseHeaders: arbitrary header column text never panics, and what it
// accepts is safe to put on the wire.
func FuzzParseHeaders(f *testing.F) {
	for _, seed := range []string{`{"traceparent":"00-1"}`, `{"a":1,"b":"x"}`, `null`, `{"Nats-Msg-Id":"x"}`, `{"a":"\r\n"}`, `[]`} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		hs, err := parseHeaders(data)
		if err != nil {
			return
		}
		for _, h := range hs {
			if validHeaderName(h.Key) != nil || reservedHeader(h.Key) || !printable(h.Value) {
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
	})
}

func splitDots(s string) []string { return strings.Split(s, ".") }
