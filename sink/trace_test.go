package sink

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"go.opentelemetry.io/contrib/propagators/b3"

	"github.com/jetbox-dev/jetbox/sink/format"

	"github.com/jetbox-dev/jetbox/internal/testenv"
	"github.com/nats-io/nats.go"
	"github.com/rs/zerolog"

	"github.com/jackc/pglogrepl"
	"github.com/jetbox-dev/jetbox/decoder"
	"go.opentelemetry.io/otel/attribute"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
)

func traceEvent(headers ...decoder.Header) *decoder.Event {
	return &decoder.Event{ID: "id-1", Subject: "outbox.order.OrderCreated", Payload: []byte(`{}`), CommitLSN: pglogrepl.LSN(0x16B3748), TxIndex: 2, Headers: headers}
}

// TestTracingOffAllocatesNothing: with no tracer provider the publish
// path's hooks are nil checks.
func TestTracingOffAllocatesNothing(t *testing.T) {
	p := &Publisher{tracing: newTracing(Config{Stream: "OUTBOX"})}
	if p.tracing != nil {
		t.Fatal("tracing on without a provider")
	}
	ev := traceEvent(decoder.Header{Key: "traceparent", Value: "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"})
	var tx txText
	h := p.header(ev, &tx, 2)
	done := func(error) {}
	allocs := testing.AllocsPerRun(100, func() {
		span := p.startSpan(ev, h)
		endSpan(span, 1, false, nil)
		_ = traceDone(span, done)
		setSpanSeq(span, 1)
	})
	if allocs != 0 {
		t.Errorf("%v allocations per event with tracing off, want 0", allocs)
	}
	if got := h["traceparent"]; len(got) != 1 || got[0] != ev.Headers[0].Value {
		t.Errorf("tracing off changed the row's traceparent: %v", got)
	}
}

// TestSpanHeaders: the span continues the row's trace (its key in any
// case), and the message carries one traceparent, the span's.
func TestSpanHeaders(t *testing.T) {
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	p := &Publisher{tracing: newTracing(Config{Stream: "OUTBOX", TracerProvider: tp})}
	const parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	for _, key := range []string{"traceparent", "TraceParent", ""} {
		var ev *decoder.Event
		if key == "" {
			ev = traceEvent(decoder.Header{Key: "tenant", Value: "acme"}, decoder.Header{Key: "tracestate", Value: "stale=1"})
		} else {
			ev = traceEvent(decoder.Header{Key: key, Value: parent}, decoder.Header{Key: "tracestate", Value: "v=1"})
		}
		var tx txText
		h := p.header(ev, &tx, 2)
		span := p.startSpan(ev, h)
		sc := span.SpanContext()
		endSpan(span, 7, true, nil)
		var n int
		for k := range h {
			if k == "traceparent" || k == "TraceParent" || k == "Traceparent" {
				n++
			}
		}
		want := "00-" + sc.TraceID().String() + "-" + sc.SpanID().String() + "-01"
		if n != 1 || h.Get("traceparent") != want {
			t.Errorf("row key %q: message headers %v, want one traceparent %s", key, h, want)
		}
		ended := rec.Ended()
		s := ended[len(ended)-1]
		if key != "" && (s.Parent().TraceID().String() != "4bf92f3577b34da6a3ce929d0e0e4736" || s.Parent().SpanID().String() != "00f067aa0ba902b7" || sc.TraceState().String() != "v=1") {
			t.Errorf("row key %q: parent %v, tracestate %q", key, s.Parent(), sc.TraceState())
		}
		if key == "" && s.Parent().IsValid() {
			t.Errorf("no traceparent: parent %v, want a root span", s.Parent())
		}
		wantTS := "v=1"
		if key == "" {
			wantTS = "" // the row's tracestate without a traceparent is dropped
		}
		if ts := h.Get("tracestate"); ts != wantTS {
			t.Errorf("row key %q: message tracestate %q, want %q", key, ts, wantTS)
		}
		if s.SpanKind() != trace.SpanKindProducer || s.Name() != "publish outbox.order.OrderCreated" {
			t.Errorf("span %q kind %v", s.Name(), s.SpanKind())
		}
		attrs := map[attribute.Key]attribute.Value{}
		for _, a := range s.Attributes() {
			attrs[a.Key] = a.Value
		}
		for k, want := range map[attribute.Key]string{"messaging.system": "nats", "messaging.message.id": "id-1",
			"messaging.destination.name": "outbox.order.OrderCreated", "jetbox.commit_lsn": "0/16B3748", "jetbox.outcome": "duplicate"} {
			if got := attrs[k].Emit(); got != want {
				t.Errorf("attribute %s = %q, want %q", k, got, want)
			}
		}
		if attrs[AttrSeq].AsInt64() != 7 || attrs[AttrTxIndex].AsInt64() != 2 {
			t.Errorf("attributes %v", attrs)
		}
	}
	// An error ends the span with the error status (atomic: through done).
	ev := traceEvent()
	var tx txText
	called := false
	done := traceDone(p.startSpan(ev, p.header(ev, &tx, 2)), func(error) { called = true })
	done(errors.New("boom"))
	s := rec.Ended()[len(rec.Ended())-1]
	if !called || s.Status().Description != "boom" || s.Status().Code.String() != "Error" {
		t.Errorf("done called %v, span status %v", called, s.Status())
	}
	_ = tp.Shutdown(context.Background())
}

// discardExporter drops every span (the cost measured is jetbox's and the SDK's, not an exporter's).
type discardExporter struct{}

func (discardExporter) ExportSpans(context.Context, []sdktrace.ReadOnlySpan) error { return nil }
func (discardExporter) Shutdown(context.Context) error                             { return nil }

// BenchmarkPublishSpan is the per-event cost of a span in the publish path:
// off (no provider), and on with every span sampled into a batch span
// processor whose exporter discards.
func BenchmarkPublishSpan(b *testing.B) {
	ev := traceEvent(decoder.Header{Key: "traceparent", Value: "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"})
	for _, on := range []bool{false, true} {
		name := "off"
		p := &Publisher{}
		var tp *sdktrace.TracerProvider
		if on {
			name = "on"
			tp = sdktrace.NewTracerProvider(sdktrace.WithBatcher(discardExporter{}), sdktrace.WithSampler(sdktrace.AlwaysSample()))
			p.tracing = newTracing(Config{Stream: "OUTBOX", TracerProvider: tp})
		}
		b.Run(name, func(b *testing.B) {
			b.ReportAllocs()
			var tx txText
			for i := 0; i < b.N; i++ {
				h := p.header(ev, &tx, 2)
				endSpan(p.startSpan(ev, h), uint64(i+1), false, nil)
			}
		})
		if tp != nil {
			_ = tp.Shutdown(context.Background())
		}
	}
}

// TestAbandonedSpansEnd: a Close whose deadline passes abandons the acks in
// flight (their done never runs); their spans must still end, as errors, or
// the SDK would hold them forever (found by a review: 3 started, 0 ended).
// Every span ends once, with the outcome its event had.
func TestAbandonedSpansEnd(t *testing.T) {
	if testing.Short() {
		t.Skip("server test")
	}
	n := testenv.StartNATS(t)
	px := testenv.StartProxy(t, n.URL[len("nats://"):])
	nc, err := nats.Connect("nats://"+px.Addr, nats.MaxReconnects(-1))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	p, err := New(nc, Config{Stream: "OUTBOX", SubjectPrefix: "outbox", DuplicateWindow: time.Minute, PublishTimeout: time.Minute,
		MaxPending: 64, Delivery: DedupGuarded, TracerProvider: tp}, zerolog.Nop())
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if _, err := p.EnsureStream(ctx); err != nil {
		t.Fatal(err)
	}
	s, err := p.Open(ctx, "test")
	if err != nil {
		t.Fatal(err)
	}
	// One event stored, then the link blackholed under three more.
	stored := make(chan error, 1)
	ev := traceEvent()
	ev.Origin, ev.TxIndex = "test", 0
	if err := s.Publish(ev, func(err error) { stored <- err }); err != nil {
		t.Fatal(err)
	}
	if err := <-stored; err != nil {
		t.Fatal(err)
	}
	px.Pause()
	for i := 1; i <= 3; i++ {
		ev := traceEvent()
		ev.ID, ev.Origin, ev.TxIndex = fmt.Sprint("id-", i+1), "test", i
		if err := s.Publish(ev, func(error) {}); err != nil {
			t.Fatal(err)
		}
	}
	cctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancel()
	if err := s.Close(cctx); err == nil {
		t.Fatal("Close returned nil with the link blackholed")
	}
	px.Resume()
	ended := rec.Ended()
	if len(rec.Started()) != 4 || len(ended) != 4 {
		t.Fatalf("%d spans started, %d ended, want 4 and 4", len(rec.Started()), len(ended))
	}
	for i, sp := range ended {
		want := OutcomeError
		if i == 0 {
			want = OutcomePublished
		}
		for _, a := range sp.Attributes() {
			if a.Key == AttrOutcome && a.Value.AsString() != want {
				t.Errorf("span %d: outcome %s, want %s", i, a.Value.AsString(), want)
			}
		}
	}
}

// TestSpanNameWithAggregateIDs: with {aggregate_id} in the subjects, spans
// are named after the template's filter, not one name per aggregate.
func TestSpanNameWithAggregateIDs(t *testing.T) {
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	cfg := Config{Stream: "OUTBOX", TracerProvider: tp, SubjectFilter: "outbox.*.*.*", SubjectsHoldIDs: true}
	p := &Publisher{tracing: newTracing(cfg)}
	ev := traceEvent()
	ev.Subject = "outbox.order.17.OrderCreated"
	var tx txText
	endSpan(p.startSpan(ev, p.header(ev, &tx, 2)), 1, false, nil)
	s := rec.Ended()[0]
	var tmpl, dest string
	for _, a := range s.Attributes() {
		switch a.Key {
		case "messaging.destination.template":
			tmpl = a.Value.AsString()
		case "messaging.destination.name":
			dest = a.Value.AsString()
		}
	}
	if s.Name() != "publish outbox.*.*.*" || tmpl != "outbox.*.*.*" || dest != ev.Subject {
		t.Fatalf("span %q, template %q, destination %q", s.Name(), tmpl, dest)
	}
	if spanTemplate(Config{SubjectFilter: "outbox.*.*"}) != "" {
		t.Fatal("subjects without ids: spans must keep their subject as name")
	}
}

// TestIndexSchemeHeader: Jetbox-Index-Scheme is set only under a non-empty
// scheme, so --source=table messages stay as they were.
func TestIndexSchemeHeader(t *testing.T) {
	for _, scheme := range []string{"", "table,messages:jetbox"} {
		p := &Publisher{cfg: Config{Stream: "OUTBOX", IndexScheme: scheme}}
		var tx txText
		h := p.header(traceEvent(), &tx, 2)
		got, ok := h[format.HeaderIndexScheme]
		switch {
		case scheme == "" && ok:
			t.Errorf("table-only source: header %s = %q, want none", format.HeaderIndexScheme, got)
		case scheme != "" && (len(got) != 1 || got[0] != scheme):
			t.Errorf("header %s = %q, want %q", format.HeaderIndexScheme, got, scheme)
		}
	}
}

// TestRoutingHeader: Jetbox-Routing is set only when configured (a
// non-default routing, or atomic batches), so default messages stay as
// they were, and the tip reads it back with Jetbox-Tx-Last.
func TestRoutingHeader(t *testing.T) {
	for _, routing := range []string{"", "template={prefix}.{aggregate_type}.{partition}.{event_type} partitions=4 atomic"} {
		p := &Publisher{cfg: Config{Stream: "OUTBOX", Routing: routing}}
		var tx txText
		ev := traceEvent()
		ev.Origin, ev.AggregateType, ev.AggregateID, ev.EventType = "42/1/app/jetbox", "order", "o-1", "OrderCreated"
		h := p.header(ev, &tx, 2)
		got, ok := h[format.HeaderRouting]
		switch {
		case routing == "" && ok:
			t.Errorf("default routing: header %s = %q, want none", format.HeaderRouting, got)
		case routing != "" && (len(got) != 1 || got[0] != routing):
			t.Errorf("header %s = %q, want %q", format.HeaderRouting, got, routing)
		}
		h[format.HeaderTxLast] = []string{"true"}
		tip, ok := tipOf(7, ev.Subject, time.Now(), h, mustWriter(t, ev.Origin))
		if !ok || tip.Routing != routing || !tip.TxLast || tip.AggregateType != ev.AggregateType || tip.AggregateID != ev.AggregateID || tip.EventType != ev.EventType {
			t.Errorf("tip %+v (ok %v), want routing %q, Tx-Last and the event's fields", tip, ok, routing)
		}
	}
}

func mustWriter(t *testing.T, source string) string {
	t.Helper()
	o, ok := format.ParseOrigin(source)
	if !ok {
		t.Fatalf("source %q", source)
	}
	return o.Writer()
}

// TestSpanStartsAtDecode: an event stamped at decode starts its span there,
// so the span shows the wait for the in-flight window as well, and carries
// when the walsender sent it.
func TestSpanStartsAtDecode(t *testing.T) {
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	p := &Publisher{tracing: newTracing(Config{Stream: "OUTBOX", TracerProvider: tp})}
	ev := traceEvent()
	ev.Decoded = time.Now().Add(-time.Second)
	ev.WALSent = ev.Decoded.Add(-time.Millisecond)
	var tx txText
	endSpan(p.startSpan(ev, p.header(ev, &tx, 2)), 1, false, nil)
	span := rec.Ended()[0]
	if got := span.StartTime(); !got.Equal(ev.Decoded) {
		t.Fatalf("span starts %s, want the decode time %s", got, ev.Decoded)
	}
	var sent int64
	for _, a := range span.Attributes() {
		if a.Key == AttrWALSent {
			sent = a.Value.AsInt64()
		}
	}
	if sent != ev.WALSent.UnixNano() {
		t.Errorf("%s = %d, want the walsender's send time %d", AttrWALSent, sent, ev.WALSent.UnixNano())
	}
}

// TestSpanHeadersB3: with another propagator (OTEL_PROPAGATORS=b3) the
// span continues the row's B3 context and the message carries the span's,
// in B3 too.
func TestSpanHeadersB3(t *testing.T) {
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	p := &Publisher{tracing: newTracing(Config{Stream: "OUTBOX", TracerProvider: tp, Propagator: b3.New()})}
	ev := traceEvent(decoder.Header{Key: "b3", Value: "4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-1"})
	var tx txText
	h := p.header(ev, &tx, 2)
	span := p.startSpan(ev, h)
	sc := span.SpanContext()
	endSpan(span, 7, false, nil)
	s := rec.Ended()[0]
	if s.Parent().TraceID().String() != "4bf92f3577b34da6a3ce929d0e0e4736" || s.Parent().SpanID().String() != "00f067aa0ba902b7" {
		t.Fatalf("parent %v, want the row's b3 context", s.Parent())
	}
	if want := sc.TraceID().String() + "-" + sc.SpanID().String() + "-1"; h.Get("b3") != want || h.Get("traceparent") != "" {
		t.Fatalf("message headers %v, want b3 %s and no traceparent", h, want)
	}
}
