package decoder

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jetbox-dev/jetbox/sink/format"

	"github.com/nats-io/nats-server/v2/server"
)

func TestParseTemplate(t *testing.T) {
	good := []struct {
		text       string
		partitions int
		filter     string
	}{
		{DefaultSubjectTemplate, 0, "outbox.*.*"},
		{"{prefix}.{aggregate_type}.{aggregate_id}.{event_type}", 0, "outbox.*.*.*"},
		{"{prefix}.{aggregate_type}.{partition}.{event_type}", 4, "outbox.*.*.*"},
		{"{prefix}.v1.{aggregate_type}.p{partition}", 16, "outbox.v1.*.*"},
		{"{prefix}.events", 0, "outbox.events"},
	}
	for _, g := range good {
		tpl, err := ParseTemplate(g.text, g.partitions)
		if err != nil {
			t.Errorf("%s: %v", g.text, err)
			continue
		}
		if f := tpl.Filter("outbox"); f != g.filter {
			t.Errorf("%s: filter %q, want %q", g.text, f, g.filter)
		}
	}
	bad := []struct {
		text       string
		partitions int
		want       string
	}{
		{"{aggregate_type}.{prefix}", 0, "must start with the token {prefix}"},
		{"{prefix}", 0, "no token after"},
		{"{prefix}.{aggregate_type}..{event_type}", 0, "empty token"},
		{"{prefix}.{aggregate_type}.", 0, "empty token"},
		{"{prefix}.{aggregatetype}", 0, "unknown placeholder {aggregatetype}"},
		{"{prefix}.{aggregate_type", 0, "'{' without '}'"},
		{"{prefix}.aggregate_type}", 0, "'}' without '{'"},
		{"{prefix}.{prefix}", 0, "may only be the first token"},
		{"{prefix}.*.{event_type}", 0, "reserve"},
		{"{prefix}.>", 0, "reserve"},
		{"{prefix}.a b", 0, "whitespace"},
		{"{prefix}._dlq.{event_type}", 0, "may not start with '_'"},
		{"{prefix}.{aggregate_type}.{partition}", 0, "number of partitions is 0"},
		{"{prefix}.{aggregate_type}", 4, "has no {partition} token"},
		{"{prefix}.{partition}", -1, "negative"},
	}
	for _, b := range bad {
		if _, err := ParseTemplate(b.text, b.partitions); err == nil || !strings.Contains(err.Error(), b.want) {
			t.Errorf("%s (%d): %v, want %q", b.text, b.partitions, err, b.want)
		}
	}
}

func TestRenderTemplate(t *testing.T) {
	tpl, err := ParseTemplate("{prefix}.{aggregate_type}.{aggregate_id}.p{partition}.{event_type}", 4)
	if err != nil {
		t.Fatal(err)
	}
	ev := &Event{AggregateType: "order", AggregateID: "o-17", EventType: "OrderPaid"}
	got, err := tpl.Render("acme.outbox", ev)
	want := fmt.Sprintf("acme.outbox.order.o-17.p%d.OrderPaid", Partition("o-17", 4))
	if err != nil || got != want {
		t.Fatalf("%q %v, want %q", got, err, want)
	}
	for _, id := range []string{"a.b", "*", ">", "a b", "", "a\tb"} {
		ev.AggregateID = id
		if _, err := tpl.Render("outbox", ev); err == nil || !strings.Contains(err.Error(), "aggregate_id") {
			t.Errorf("aggregate_id %q: %v", id, err)
		}
	}
	// A value that starts a token may not start with '_' (jetbox's own
	// subjects: <prefix>._dlq, <prefix>._jetbox); inside one it may.
	for _, id := range []string{"_dlq", "_jetbox"} {
		ev.AggregateID = id
		if _, err := tpl.Render("outbox", ev); err == nil || !strings.Contains(err.Error(), "'_'") {
			t.Errorf("aggregate_id %q: %v", id, err)
		}
	}
	inner, _ := ParseTemplate("{prefix}.x{aggregate_type}.{event_type}", 0)
	if got, err := inner.Render("outbox", &Event{AggregateType: "_a", EventType: "E"}); err != nil || got != "outbox.x_a.E" {
		t.Errorf("inside a token: %q %v", got, err)
	}
	ev.AggregateID = "o-17"
	// The default template renders today's subjects.
	def, _ := ParseTemplate(DefaultSubjectTemplate, 0)
	ev.AggregateID = "x.y" // not in the subject: no matter
	if got, err := def.Render("outbox", ev); err != nil || got != "outbox.order.OrderPaid" {
		t.Fatalf("default: %q %v", got, err)
	}
}

// The documented vector: FNV-1a 32 of the UTF-8 bytes, modulo N.
func TestPartitionVector(t *testing.T) {
	for _, v := range []struct {
		id   string
		n    int
		want int
	}{
		// FNV-1a 32: "" = 0x811c9dc5, "a" = 0xe40c292c, "foobar" = 0xbf9cf968
		// (the published FNV test values); "order-17" = 0xd43044ae (docs/routing.md).
		{"", 4, 0x811c9dc5 % 4},
		{"order-17", 4, 2},
		{"order-17", 16, 0xd43044ae % 16},
		{"a", 4, 0xe40c292c % 4},
		{"foobar", 7, 0xbf9cf968 % 7},
		{"foobar", 1, 0},
		{"a", 0, 0},
	} {
		if got := Partition(v.id, v.n); got != v.want {
			t.Errorf("Partition(%q, %d) = %d, want %d", v.id, v.n, got, v.want)
		}
	}
}

// Partition matches nats-server's subject-transform partition(n, token):
// a stream that maps <prefix>.<type>.<id>.<event> with
// {{partition(n,3)}} computes the partition jetbox puts in the subject.
func TestPartitionMatchesNATSTransform(t *testing.T) {
	const n = 7
	tr, err := server.NewSubjectTransform("outbox.*.*.*", fmt.Sprintf("p.{{partition(%d,2)}}", n))
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 2000; i++ {
		id := fmt.Sprintf("agg-%d-é", i)
		got := tr.TransformSubject("outbox.order." + id + ".E")
		if want := fmt.Sprintf("p.%d", Partition(id, n)); got != want {
			t.Fatalf("id %q: nats-server %q, jetbox %q", id, got, want)
		}
	}
}

// The template applies to rows: a value that is not one token is a
// bad-subject row, including an aggregate_id only the template uses.
func TestTemplateRows(t *testing.T) {
	tpl, _ := ParseTemplate("{prefix}.{aggregate_type}.{aggregate_id}.{partition}", 4)
	d := New(Config{Schema: "public", Table: "outbox", Columns: DefaultColumns, SubjectPrefix: "outbox", Subjects: tpl, MessagePrefix: "jetbox"})
	decode(t, d, relationMsg(5, "public", "outbox", outboxCols))
	decode(t, d, beginMsg(1, time.Now(), 1))
	m := decode(t, d, insertMsg(5, s(id1), s("order"), s("o-1"), s("E"), s(`{}`), nil, nil))
	if want := fmt.Sprintf("outbox.order.o-1.%d", Partition("o-1", 4)); m.Event.Subject != want {
		t.Fatalf("subject %q, want %q", m.Event.Subject, want)
	}
	_, err := d.Decode(insertMsg(5, s(id1), s("order"), s("o.1"), s("E"), s(`{}`), nil, nil))
	var ie *InvalidEventError
	if !errors.As(err, &ie) || ie.Code != format.ReasonBadSubject || !strings.Contains(ie.Error(), "aggregate_id") {
		t.Fatalf("%v", err)
	}
	_, err = d.Decode(logicalMsg(true, 1, "jetbox", `{"id":"m1","aggregate_type":"order","aggregate_id":"o 1","event_type":"E","payload":1}`))
	if !errors.As(err, &ie) || ie.Code != format.ReasonBadSubject || !ie.Message {
		t.Fatalf("message: %v", err)
	}
}

// TestSubjectLength: a subject longer than MaxSubjectLength is a bad-subject
// row (the server would close the connection on it), for the historical
// template's event_type, a template's aggregate_id and an envelope alike;
// one at the limit is published; with dead-lettering it becomes a dead
// letter whose headers stay short.
func TestSubjectLength(t *testing.T) {
	const max = 100
	tpl, _ := ParseTemplate("{prefix}.{aggregate_type}.{aggregate_id}", 0)
	fit := strings.Repeat("E", max-len("outbox.order.")) // "outbox.order.EEE…" is max bytes
	for _, c := range []struct {
		name     string
		subjects *Template
		aggID    string
		evType   string
		message  bool
	}{
		{"event_type", nil, "1", strings.Repeat("E", 5000), false},
		{"aggregate_id in the template", tpl, strings.Repeat("1", 5000), "E", false},
		{"envelope", nil, "1", strings.Repeat("E", 5000), true},
	} {
		t.Run(c.name, func(t *testing.T) {
			for _, dlq := range []string{"", "outbox._dlq"} {
				d := New(Config{Schema: "public", Table: "outbox", Columns: DefaultColumns, SubjectPrefix: "outbox",
					Subjects: c.subjects, MessagePrefix: "jetbox", MaxSubjectLength: max, DeadLetterSubject: dlq})
				decode(t, d, relationMsg(5, "public", "outbox", outboxCols))
				decode(t, d, beginMsg(0x10, time.Now(), 1))
				if c.subjects == nil {
					m := decode(t, d, insertMsg(5, s(id1), s("order"), s("1"), s(fit), s(`{}`), nil, nil))
					if m.Event.DeadLetter != nil || len(m.Event.Subject) != max {
						t.Fatalf("a subject of %d bytes, at the limit: %+v", len(m.Event.Subject), m.Event)
					}
				}
				var m Message
				var err error
				if c.message {
					m, err = d.Decode(logicalMsg(true, 1, "jetbox", fmt.Sprintf(`{"id":"m1","aggregate_type":"order","aggregate_id":%q,"event_type":%q,"payload":1}`, c.aggID, c.evType)))
				} else {
					m, err = d.Decode(insertMsg(5, s(id1), s("order"), s(c.aggID), s(c.evType), s(`{}`), nil, nil))
				}
				if dlq == "" {
					var ie *InvalidEventError
					if !errors.As(err, &ie) || ie.Code != format.ReasonBadSubject || ie.ID == "" ||
						!strings.Contains(err.Error(), "over the limit of 100") || !strings.Contains(err.Error(), "max_control_line") || len(err.Error()) > 1024 {
						t.Fatalf("got %v", err)
					}
					continue
				}
				if err != nil {
					t.Fatal(err)
				}
				dl := m.Event
				if dl.Subject != "outbox._dlq.bad-subject" || dl.DeadLetter == nil || len(dl.Subject) > max {
					t.Fatalf("dead letter %s %+v", dl.Subject, dl.DeadLetter)
				}
				for _, h := range dl.Headers {
					if len(h.Value) > 1100 {
						t.Fatalf("dead-letter header %s of %d bytes", h.Key, len(h.Value))
					}
				}
			}
		})
	}
}

// TestRoutingHeader: Jetbox-Routing names a non-default template and its
// partitions, and atomic batches; it is absent otherwise (default messages
// do not grow), reads back as it was written, and counts in the size
// estimate.
func TestRoutingHeader(t *testing.T) {
	tpl := func(text string, n int) *Template {
		t.Helper()
		tp, err := ParseTemplate(text, n)
		if err != nil {
			t.Fatal(err)
		}
		return tp
	}
	const parted = "{prefix}.{aggregate_type}.{partition}.{event_type}"
	for _, c := range []struct {
		cfg        Config
		want       string
		template   string
		partitions int
	}{
		{Config{}, "", DefaultSubjectTemplate, 0},
		{Config{Subjects: tpl(DefaultSubjectTemplate, 0)}, "", DefaultSubjectTemplate, 0},
		{Config{Atomic: true}, "atomic", DefaultSubjectTemplate, 0},
		{Config{Subjects: tpl(parted, 4)}, "template=" + parted + " partitions=4", parted, 4},
		{Config{Subjects: tpl(parted, 16), Atomic: true}, "template=" + parted + " partitions=16 atomic", parted, 16},
		{Config{Subjects: tpl("{prefix}.{aggregate_type}.{aggregate_id}", 0)}, "template={prefix}.{aggregate_type}.{aggregate_id}", "{prefix}.{aggregate_type}.{aggregate_id}", 0},
	} {
		got := c.cfg.RoutingHeader()
		if got != c.want {
			t.Errorf("%+v: RoutingHeader() = %q, want %q", c.cfg, got, c.want)
		}
		template, partitions, atomic := ParseRouting(got)
		if template != c.template || partitions != c.partitions || atomic != c.cfg.Atomic {
			t.Errorf("ParseRouting(%q) = %q %d %v", got, template, partitions, atomic)
		}
	}
	if _, _, atomic := ParseRouting("future=1 atomic"); !atomic {
		t.Error("an unknown field hides atomic")
	}
}
