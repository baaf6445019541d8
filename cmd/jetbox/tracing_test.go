package main

import (
	"compress/gzip"
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jetbox-dev/jetbox/sink/format"

	"github.com/jetbox-dev/jetbox/internal/metrics"
	"github.com/jetbox-dev/jetbox/internal/testenv"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/rs/zerolog"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	coltracepb "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	commonpb "go.opentelemetry.io/proto/otlp/common/v1"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/proto"
)

// otlpReceiver is an OTLP/HTTP trace endpoint: it decodes the collector
// protocol's protobuf requests, as a collector's otlpreceiver does.
type otlpReceiver struct {
	*httptest.Server
	mu    sync.Mutex
	spans []receivedSpan
}

type receivedSpan struct {
	service string // the resource's service.name
	*tracepb.Span
}

func startOTLP(t *testing.T) *otlpReceiver {
	r := &otlpReceiver{}
	r.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		if req.URL.Path != "/v1/traces" || req.Method != http.MethodPost {
			http.Error(w, "not an OTLP trace export", http.StatusNotFound)
			t.Errorf("OTLP receiver: %s %s", req.Method, req.URL.Path)
			return
		}
		var body io.Reader = req.Body
		if req.Header.Get("Content-Encoding") == "gzip" {
			gz, err := gzip.NewReader(req.Body)
			if err != nil {
				http.Error(w, err.Error(), http.StatusBadRequest)
				return
			}
			body = gz
		}
		b, err := io.ReadAll(body)
		var export coltracepb.ExportTraceServiceRequest
		if err == nil {
			err = proto.Unmarshal(b, &export)
		}
		if err != nil || req.Header.Get("Content-Type") != "application/x-protobuf" {
			http.Error(w, fmt.Sprintf("decode %s: %v", req.Header.Get("Content-Type"), err), http.StatusBadRequest)
			t.Errorf("OTLP receiver: decode %s: %v", req.Header.Get("Content-Type"), err)
			return
		}
		r.mu.Lock()
		for _, rs := range export.ResourceSpans {
			service := attrString(rs.GetResource().GetAttributes(), "service.name")
			for _, ss := range rs.ScopeSpans {
				for _, s := range ss.Spans {
					r.spans = append(r.spans, receivedSpan{service: service, Span: s})
				}
			}
		}
		r.mu.Unlock()
		out, _ := proto.Marshal(&coltracepb.ExportTraceServiceResponse{})
		w.Header().Set("Content-Type", "application/x-protobuf")
		_, _ = w.Write(out)
	}))
	t.Cleanup(r.Close)
	return r
}

// byID returns the spans received so far, by messaging.message.id.
func (r *otlpReceiver) byID() map[string][]receivedSpan {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := map[string][]receivedSpan{}
	for _, s := range r.spans {
		id := attrString(s.Attributes, "messaging.message.id")
		out[id] = append(out[id], s)
	}
	return out
}

func attrString(kvs []*commonpb.KeyValue, key string) string {
	for _, kv := range kvs {
		if kv.Key == key {
			switch v := kv.Value.Value.(type) {
			case *commonpb.AnyValue_StringValue:
				return v.StringValue
			case *commonpb.AnyValue_IntValue:
				return strconv.FormatInt(v.IntValue, 10)
			}
		}
	}
	return ""
}

// traceHeaders returns the message's trace headers, in whatever case.
func traceHeaders(h map[string][]string, name string) []string {
	var out []string
	for k, vs := range h {
		if strings.EqualFold(k, name) {
			out = append(out, vs...)
		}
	}
	return out
}

// TestTracing runs jetbox with OTEL_EXPORTER_OTLP_ENDPOINT at an OTLP/HTTP
// receiver: each event's producer span arrives, a child of the row's
// traceparent (and tracestate) when it has one, a root otherwise, with the
// messaging and jetbox attributes; the message's traceparent is the span's
// (one header, whatever case the row used). A second run with a one-hour
// batch delay shows the last spans are exported at stop; a third, atomic,
// that atomic batches trace their events too.
func TestTracing(t *testing.T) {
	f := newFixture(t)
	rcv := startOTLP(t)
	otelEnv := []string{"OTEL_EXPORTER_OTLP_ENDPOINT=" + rcv.URL, "OTEL_SERVICE_NAME=jetbox-test", "OTEL_TRACES_SAMPLER=parentbased_always_on"}
	p := f.start(append(otelEnv, "OTEL_BSP_SCHEDULE_DELAY=100")...)
	f.waitStreaming(p)

	const parentTrace, parentSpan = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
	conn := f.conn()
	ctx := ctxT(t, time.Minute)
	insert := func(headers string) string {
		t.Helper()
		var h any
		if headers != "" {
			h = headers
		}
		var id string
		if err := conn.QueryRow(ctx, `INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, headers)
			VALUES ('order', 'o-1', 'OrderCreated', '{"n": 1}', $1::jsonb) RETURNING id::text`, h).Scan(&id); err != nil {
			t.Fatal(err)
		}
		return id
	}
	child := insert(`{"traceparent": "00-` + parentTrace + `-` + parentSpan + `-01", "tracestate": "vendor=abc", "tenant": "acme"}`)
	root := insert(``)
	spelled := insert(`{"Traceparent": "00-` + parentTrace + `-` + parentSpan + `-01"}`)
	f.waitCount(3, 30*time.Second)
	msgs := testenv.ReadStream(t, f.js, "OUTBOX", true)

	var spans map[string][]receivedSpan
	testenv.WaitFor(t, 30*time.Second, func() error {
		spans = rcv.byID()
		for _, id := range []string{child, root, spelled} {
			if len(spans[id]) == 0 {
				return fmt.Errorf("no span yet for event %s (spans for %d events)", id, len(spans))
			}
		}
		return nil
	})
	for _, m := range msgs {
		got := spans[m.ID]
		if len(got) != 1 {
			t.Fatalf("event %s: %d spans, want 1", m.ID, len(got))
		}
		s := got[0]
		if want := "publish " + m.Subject; s.Name != want {
			t.Errorf("event %s: span %q, want %q", m.ID, s.Name, want)
		}
		if s.Kind != tracepb.Span_SPAN_KIND_PRODUCER {
			t.Errorf("event %s: span kind %v, want producer", m.ID, s.Kind)
		}
		if s.service != "jetbox-test" {
			t.Errorf("event %s: service.name %q, want OTEL_SERVICE_NAME's jetbox-test", m.ID, s.service)
		}
		if s.EndTimeUnixNano < s.StartTimeUnixNano || s.StartTimeUnixNano == 0 {
			t.Errorf("event %s: span from %d to %d", m.ID, s.StartTimeUnixNano, s.EndTimeUnixNano)
		}
		for k, want := range map[string]string{
			"messaging.system": "nats", "messaging.destination.name": m.Subject, "messaging.operation.type": "send",
			"jetbox.commit_lsn": m.Header.Get(format.HeaderCommitLSN), "jetbox.tx_index": m.Header.Get(format.HeaderTxIndex),
			"jetbox.stream": "OUTBOX", "jetbox.stream_sequence": strconv.FormatUint(m.Seq, 10), "jetbox.outcome": "published",
			"server.address": "127.0.0.1", "server.port": natsPort(t, f.natURL),
		} {
			if got := attrString(s.Attributes, k); got != want {
				t.Errorf("event %s: span attribute %s = %q, want %q", m.ID, k, got, want)
			}
		}
		traceID, spanID := hex.EncodeToString(s.TraceId), hex.EncodeToString(s.SpanId)
		switch m.ID {
		case child, spelled:
			if traceID != parentTrace || hex.EncodeToString(s.ParentSpanId) != parentSpan {
				t.Errorf("event %s: span in trace %s under %x, want the row's trace %s under %s", m.ID, traceID, s.ParentSpanId, parentTrace, parentSpan)
			}
		case root:
			if len(s.ParentSpanId) != 0 || traceID == parentTrace {
				t.Errorf("event %s (no traceparent): span in trace %s under %x, want a new root", m.ID, traceID, s.ParentSpanId)
			}
		}
		wantTS := ""
		if m.ID == child {
			wantTS = "vendor=abc"
		}
		if s.TraceState != wantTS {
			t.Errorf("event %s: span tracestate %q, want %q", m.ID, s.TraceState, wantTS)
		}
		tp := traceHeaders(m.Header, "traceparent")
		if want := "00-" + traceID + "-" + spanID + "-01"; len(tp) != 1 || tp[0] != want || m.Header.Get("traceparent") != want {
			t.Errorf("event %s: message traceparent %q (headers %v), want one, the span's: %s", m.ID, tp, m.Header, want)
		}
		if m.ID == child {
			if ts := m.Header.Get("tracestate"); ts != "vendor=abc" {
				t.Errorf("event %s: message tracestate %q, want the row's", m.ID, ts)
			}
			if m.Header.Get("tenant") != "acme" {
				t.Errorf("event %s: the row's other headers are lost: %v", m.ID, m.Header)
			}
		}
	}
	if code := p.stop(); code != 0 {
		t.Fatalf("jetbox exited with %d", code)
	}

	// Flush at stop: with a one-hour batch delay the span can only be
	// exported by the shutdown. Atomic transactions trace each event.
	for _, env := range [][]string{nil, {exactlyOnce, atomicTx}} {
		if env != nil {
			st, err := f.js.Stream(ctxT(t, 5*time.Second), "OUTBOX")
			must(t, err)
			cfg := st.CachedInfo().Config
			cfg.AllowAtomicPublish = true
			_, err = f.js.UpdateStream(ctxT(t, 5*time.Second), cfg)
			must(t, err)
		}
		p = f.start(append(append(otelEnv, "OTEL_BSP_SCHEDULE_DELAY=3600000"), env...)...)
		f.waitStreaming(p)
		id := insert(`{"traceparent": "00-` + parentTrace + `-` + parentSpan + `-01"}`)
		f.waitCount(len(msgs)+1, 30*time.Second)
		msgs = testenv.ReadStream(t, f.js, "OUTBOX", true)
		last := msgs[len(msgs)-1]
		if last.ID != id {
			t.Fatalf("last message %s, want %s", last.ID, id)
		}
		if n := len(rcv.byID()[id]); n != 0 {
			t.Fatalf("%v: a span exported before the stop with a one-hour batch delay (%d)", env, n)
		}
		if code := p.stop(); code != 0 {
			t.Fatalf("%v: jetbox exited with %d", env, code)
		}
		got := rcv.byID()[id]
		if len(got) != 1 {
			t.Fatalf("%v: %d spans for the event once jetbox stopped, want 1 (exported at stop)", env, len(got))
		}
		s := got[0]
		if hex.EncodeToString(s.TraceId) != parentTrace || hex.EncodeToString(s.ParentSpanId) != parentSpan ||
			attrString(s.Attributes, "jetbox.outcome") != "published" || attrString(s.Attributes, "jetbox.stream_sequence") != strconv.FormatUint(last.Seq, 10) {
			t.Errorf("%v: span %s in trace %x under %x, attributes %v; message seq %d", env, s.Name, s.TraceId, s.ParentSpanId, s.Attributes, last.Seq)
		}
		if want := "00-" + parentTrace + "-" + hex.EncodeToString(s.SpanId) + "-01"; last.Header.Get("traceparent") != want {
			t.Errorf("%v: message traceparent %q, want the span's %s", env, last.Header.Get("traceparent"), want)
		}
	}
}

// TestTracingOff: without an OTLP endpoint (or with tracing disabled) there
// is no tracer provider; bad OTEL_* values are reported all at once.
func TestTracingOff(t *testing.T) {
	m := metrics.New()
	otelVars := []string{"OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_SDK_DISABLED", "OTEL_TRACES_EXPORTER",
		"OTEL_SERVICE_NAME", "OTEL_TRACES_SAMPLER", "OTEL_TRACES_SAMPLER_ARG", "OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_BSP_MAX_QUEUE_SIZE", "OTEL_PROPAGATORS"}
	setenv := func(kv ...string) {
		for _, k := range otelVars {
			t.Setenv(k, "")
		}
		for i := 0; i+1 < len(kv); i += 2 {
			t.Setenv(kv[i], kv[i+1])
		}
	}
	for _, env := range [][]string{
		{},
		{"OTEL_SERVICE_NAME", "x", "OTEL_TRACES_SAMPLER", "always_on"},
		{"OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:1", "OTEL_SDK_DISABLED", "true"},
		{"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://127.0.0.1:1", "OTEL_TRACES_EXPORTER", "none"},
	} {
		setenv(env...)
		tp, _, stop, err := startTracing(context.Background(), m, zerolog.Nop())
		if err != nil || tp != nil {
			t.Fatalf("%v: tracing on (%v) or error %v", env, tp, err)
		}
		stop()
	}
	// The console exporter needs no endpoint; OTEL_PROPAGATORS picks the propagator.
	setenv("OTEL_TRACES_EXPORTER", "console", "OTEL_PROPAGATORS", "b3multi")
	tp, prop, stop, err := startTracing(context.Background(), m, zerolog.Nop())
	if err != nil || tp == nil || !slices.Contains(prop.Fields(), "x-b3-traceid") {
		t.Fatalf("console exporter, b3multi: provider %v, propagator fields %v, error %v", tp, prop, err)
	}
	stop()
	setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:1",
		"OTEL_EXPORTER_OTLP_PROTOCOL", "http/json", "OTEL_TRACES_SAMPLER", "sometimes", "OTEL_BSP_MAX_QUEUE_SIZE", "-1",
		"OTEL_TRACES_EXPORTER", "zipkin", "OTEL_PROPAGATORS", "tracecontext,smoke-signals")
	_, _, _, err = startTracing(context.Background(), m, zerolog.Nop())
	if err == nil {
		t.Fatal("bad OTEL_* values accepted")
	}
	for _, want := range []string{"OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_TRACES_SAMPLER", "OTEL_BSP_MAX_QUEUE_SIZE", "OTEL_TRACES_EXPORTER", "OTEL_PROPAGATORS"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not name %s", err, want)
		}
	}
	if n := len(err.(interface{ Unwrap() []error }).Unwrap()); n != 5 {
		t.Errorf("%d problems reported, want 5: %v", n, err)
	}
}

// TestSpanDropGate: a full export queue drops spans (counted), and ending a
// span never waits for the exporter.
func TestSpanDropGate(t *testing.T) {
	m := metrics.New()
	release := make(chan struct{})
	exp := &blockingExporter{InMemoryExporter: tracetest.NewInMemoryExporter(), release: release, entered: make(chan struct{}, 1)}
	gate := &dropGate{max: 4, full: m.SpansDropped.WithLabelValues("queue_full")}
	gate.SpanProcessor = sdktrace.NewBatchSpanProcessor(&countingExporter{SpanExporter: exp, gate: gate, failed: m.SpansDropped.WithLabelValues("export_failed")},
		sdktrace.WithMaxQueueSize(4), sdktrace.WithMaxExportBatchSize(1), sdktrace.WithBatchTimeout(time.Millisecond))
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(gate))
	tr := tp.Tracer("test")
	_, s := tr.Start(context.Background(), "first")
	s.End()
	select {
	case <-exp.entered: // the exporter now holds the first span and blocks
	case <-time.After(10 * time.Second):
		t.Fatal("the batch processor did not export")
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for i := 0; i < 100; i++ {
			_, s := tr.Start(context.Background(), "more")
			s.End()
		}
	}()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("ending spans waits for a blocked exporter")
	}
	if n := testutil.ToFloat64(m.SpansDropped.WithLabelValues("queue_full")); n != 96 {
		t.Errorf("jetbox_trace_spans_dropped_total{reason=queue_full} = %v, want 96 (100 ended, 4 queued)", n)
	}
	close(release)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := tp.Shutdown(ctx); err != nil {
		t.Fatal(err)
	}
	if n := exp.exported.Load(); n != 5 {
		t.Errorf("%d spans exported, want 5 (the first and the 4 queued)", n)
	}
	if n := testutil.ToFloat64(m.SpansDropped.WithLabelValues("export_failed")); n != 0 {
		t.Errorf("export_failed = %v, want 0", n)
	}
}

// blockingExporter holds every export until release is closed.
type blockingExporter struct {
	*tracetest.InMemoryExporter
	release  chan struct{}
	entered  chan struct{}
	exported atomic.Int64 // the in-memory exporter forgets them at shutdown
}

func (e *blockingExporter) ExportSpans(ctx context.Context, spans []sdktrace.ReadOnlySpan) error {
	select {
	case e.entered <- struct{}{}:
	default:
	}
	select {
	case <-e.release:
	case <-ctx.Done():
		return errors.New("export timed out")
	}
	e.exported.Add(int64(len(spans)))
	return e.InMemoryExporter.ExportSpans(ctx, spans)
}

// traceService is an OTLP/gRPC trace receiver.
type traceService struct {
	coltracepb.UnimplementedTraceServiceServer
	mu    sync.Mutex
	spans []receivedSpan
}

func (s *traceService) Export(_ context.Context, req *coltracepb.ExportTraceServiceRequest) (*coltracepb.ExportTraceServiceResponse, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, rs := range req.ResourceSpans {
		for _, ss := range rs.ScopeSpans {
			for _, sp := range ss.Spans {
				s.spans = append(s.spans, receivedSpan{service: attrString(rs.GetResource().GetAttributes(), "service.name"), Span: sp})
			}
		}
	}
	return &coltracepb.ExportTraceServiceResponse{}, nil
}

// TestTracingExportsGRPC: OTEL_EXPORTER_OTLP_PROTOCOL=grpc exports over
// OTLP/gRPC, and the stop exports what is queued.
func TestTracingExportsGRPC(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	must(t, err)
	srv := grpc.NewServer()
	svc := &traceService{}
	coltracepb.RegisterTraceServiceServer(srv, svc)
	go func() { _ = srv.Serve(l) }()
	defer srv.Stop()
	t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://"+l.Addr().String())
	t.Setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
	t.Setenv("OTEL_BSP_SCHEDULE_DELAY", "3600000")
	tp, _, stop, err := startTracing(context.Background(), metrics.New(), zerolog.Nop())
	if err != nil || tp == nil {
		t.Fatalf("tracing not on: %v", err)
	}
	_, span := tp.Tracer("test").Start(context.Background(), "jetbox publish x")
	span.End()
	stop()
	svc.mu.Lock()
	defer svc.mu.Unlock()
	if len(svc.spans) != 1 || svc.spans[0].Name != "jetbox publish x" || svc.spans[0].service != "jetbox" {
		t.Fatalf("received %v, want the one span, service.name jetbox", svc.spans)
	}
}

// natsPort is the port of a nats:// URL.
func natsPort(t *testing.T, u string) string {
	t.Helper()
	pu, err := url.Parse(u)
	if err != nil {
		t.Fatal(err)
	}
	return pu.Port()
}
