package decoder

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jetbox-dev/jetbox/sink/format"
)

func TestDomainsBaseType(t *testing.T) {
	d := Domains{16400: oidText, 16401: 16400, 16402: oidBpchar, 16500: 16501, 16501: 16500}
	for _, c := range []struct{ in, want uint32 }{
		{oidText, oidText}, // not a domain
		{16400, oidText},   // a domain over text
		{16401, oidText},   // a domain over that domain
		{16402, oidBpchar}, // a domain over char(n)
		{16999, 16999},     // an unknown type stays itself
	} {
		if got := d.BaseType(c.in); got != c.want {
			t.Errorf("BaseType(%d) = %d, want %d", c.in, got, c.want)
		}
	}
	d.BaseType(16500) // a cycle (bad input) ends
	if got := Domains(nil).BaseType(16400); got != 16400 {
		t.Errorf("nil Domains: %d", got)
	}
}

// TestDecodeDomainColumns: a Relation message gives a domain column the domain's
// OID; with the domains set, it is judged and read as its base type.
func TestDecodeDomainColumns(t *testing.T) {
	const aggT, payloadT = 16400, 16401
	cols := []col{{"id", oidUUID}, {"aggregate_type", aggT}, {"aggregate_id", oidText}, {"event_type", oidText}, {"payload", payloadT}}
	row := insertMsg(5, s(id1), s("order"), s("o-1"), s("Created"), s(`\x0102`))

	d := newTestDecoder()
	decode(t, d, relationMsg(5, "public", "outbox", cols))
	decode(t, d, beginMsg(1, time.Now(), 1))
	var ie *InvalidEventError
	if _, err := d.Decode(row); !errors.As(err, &ie) || ie.Code != format.ReasonTableChanged || !strings.Contains(err.Error(), "type oid 16400, want text") {
		t.Fatalf("without domains: %v", err)
	}

	d = newTestDecoder()
	d.SetDomains(Domains{aggT: oidVarchar, payloadT: oidBytea})
	decode(t, d, relationMsg(5, "public", "outbox", cols))
	decode(t, d, beginMsg(1, time.Now(), 1))
	m := decode(t, d, row)
	if m.Event.Subject != "outbox.order.Created" || string(m.Event.Payload) != "\x01\x02" {
		t.Fatalf("event: %+v", m.Event)
	}
	// A domain over an unsupported type is refused as that type.
	d.SetDomains(Domains{aggT: 23, payloadT: oidBytea})
	decode(t, d, relationMsg(5, "public", "outbox", cols))
	if _, err := d.Decode(row); err == nil || !strings.Contains(err.Error(), `column "aggregate_type" is int4, want text`) {
		t.Fatalf("domain over int4: %v", err)
	}
}

// TestBpcharTrimmed: char(n) values arrive space-padded; the pad is not part
// of the value, so the subject, headers and template see them trimmed. The
// id (the Nats-Msg-Id) is kept as sent.
func TestBpcharTrimmed(t *testing.T) {
	const evT = 16402 // a domain over char(n)
	cols := []col{{"id", oidBpchar}, {"aggregate_type", oidBpchar}, {"aggregate_id", oidBpchar}, {"event_type", evT}, {"payload", oidJSONB}}
	d := newTestDecoder()
	d.SetDomains(Domains{evT: oidBpchar})
	decode(t, d, relationMsg(5, "public", "outbox", cols))
	decode(t, d, beginMsg(1, time.Now(), 1))
	m := decode(t, d, insertMsg(5, s("id-1  "), s("order   "), s("o 1  "), s("Created      "), s(`{}`)))
	ev := m.Event
	if ev.Subject != "outbox.order.Created" || ev.AggregateType != "order" || ev.EventType != "Created" || ev.AggregateID != "o 1" || ev.ID != "id-1  " {
		t.Fatalf("event: %+v", ev)
	}
	// Spaces inside stay, and are still refused; all pad is an empty token.
	for _, v := range []string{"big order ", "    "} {
		var ie *InvalidEventError
		if _, err := d.Decode(insertMsg(5, s("id-2"), s(v), s("1"), s("E"), s(`{}`))); !errors.As(err, &ie) || ie.Code != format.ReasonBadSubject {
			t.Fatalf("%q: %v", v, err)
		}
	}
	// text is not trimmed: a trailing space there is the producer's.
	d = newTestDecoder()
	decode(t, d, relationMsg(5, "public", "outbox", outboxCols))
	decode(t, d, beginMsg(1, time.Now(), 1))
	if _, err := d.Decode(insertMsg(5, s(id1), s("order "), s("1"), s("E"), s(`{}`), nil, nil)); err == nil {
		t.Fatalf("text with a trailing space accepted")
	}
	// The row decoder (repair) trims the same values.
	rd := NewRowDecoder(d.cfg, []TableColumn{{"id", oidText}, {"aggregate_type", oidBpchar}, {"aggregate_id", oidText}, {"event_type", oidBpchar}, {"payload", oidJSONB}})
	ev, err := rd.Decode([][]byte{[]byte("r-1"), []byte("order  "), []byte("1"), []byte("Created "), []byte("{}")}, 1, time.Now(), 0)
	if err != nil || ev.Subject != "outbox.order.Created" {
		t.Fatalf("row decoder: %+v %v", ev, err)
	}
}
