package main

// OpenTelemetry tracing (docs/operations.md, Tracing): configured by the
// standard OTEL_* variables, off unless an OTLP endpoint is set.

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/jetbox-dev/jetbox/internal/metrics"
	"github.com/jetbox-dev/jetbox/sink"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"
	"go.opentelemetry.io/contrib/exporters/autoexport"
	"go.opentelemetry.io/contrib/propagators/autoprop"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
)

// tracingShutdownTimeout bounds the export of the last spans at stop.
const tracingShutdownTimeout = 5 * time.Second

// defaultSpanQueue is the SDK's default OTEL_BSP_MAX_QUEUE_SIZE.
const defaultSpanQueue = 2048

// startTracing returns the tracer provider and the propagator the OTEL_*
// variables describe, and the provider's shutdown (which exports the queued
// spans, bounded); a nil provider when tracing is off: neither an OTLP
// endpoint nor OTEL_TRACES_EXPORTER given, OTEL_SDK_DISABLED=true or
// OTEL_TRACES_EXPORTER=none. The exporter comes from OTEL_TRACES_EXPORTER
// (otlp, console) and the propagator from OTEL_PROPAGATORS, as the
// OpenTelemetry contrib packages autoexport and autoprop read them.
func startTracing(ctx context.Context, m *metrics.Metrics, log zerolog.Logger) (sink.TracerProvider, propagation.TextMapPropagator, func(), error) {
	off := func() {}
	getenv := os.Getenv // the SDK and the exporters read the same variables
	endpoint := getenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
	if endpoint == "" {
		endpoint = getenv("OTEL_EXPORTER_OTLP_ENDPOINT")
	}
	exporter := getenv("OTEL_TRACES_EXPORTER")
	if (endpoint == "" && exporter == "") || exporter == "none" || strings.EqualFold(getenv("OTEL_SDK_DISABLED"), "true") {
		return nil, nil, off, nil
	}
	var errs []error
	switch exporter {
	case "", "otlp", "console":
	default:
		errs = append(errs, fmt.Errorf("OTEL_TRACES_EXPORTER = %q: not an exporter jetbox has; fix: unset it (otlp), or set otlp, console (spans as JSON on stdout) or none", exporter))
	}
	prop, err := propagatorFromEnv(getenv)
	if err != nil {
		errs = append(errs, err)
	}
	protocol, penv := getenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"), "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
	if protocol == "" {
		protocol, penv = getenv("OTEL_EXPORTER_OTLP_PROTOCOL"), "OTEL_EXPORTER_OTLP_PROTOCOL"
	}
	if protocol == "" {
		protocol = "http/protobuf" // the specification's default
	}
	if protocol != "http/protobuf" && protocol != "grpc" {
		errs = append(errs, fmt.Errorf("%s = %q: not a supported OTLP protocol; fix: use http/protobuf (the default) or grpc", penv, protocol))
	}
	errs = append(errs, checkSampler(getenv)...)
	queue := defaultSpanQueue
	if v := getenv("OTEL_BSP_MAX_QUEUE_SIZE"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 {
			errs = append(errs, fmt.Errorf("OTEL_BSP_MAX_QUEUE_SIZE = %q: not a positive number; fix: unset it (%d spans) or give e.g. 8192", v, defaultSpanQueue))
		}
		queue = n
	}
	if len(errs) > 0 {
		return nil, nil, off, errors.Join(errs...)
	}

	// The exporters read the other OTEL_EXPORTER_OTLP_* variables (headers,
	// timeout, compression, certificates) themselves.
	exp, err := autoexport.NewSpanExporter(ctx)
	if err != nil {
		return nil, nil, off, fmt.Errorf("trace exporter (%s, %s, %s): %w", cmp.Or(exporter, "otlp"), protocol, endpoint, err)
	}
	// service.name "jetbox" unless OTEL_SERVICE_NAME or
	// OTEL_RESOURCE_ATTRIBUTES say otherwise (later detectors win).
	res, err := resource.New(ctx,
		resource.WithAttributes(semconv.ServiceName("jetbox"), semconv.ServiceVersion(version)),
		resource.WithTelemetrySDK(), resource.WithHost(), resource.WithFromEnv())
	if err != nil {
		log.Warn().Err(err).Msg("tracing: part of the resource could not be detected")
	}
	tlog := log.With().Str("component", "tracing").Logger()
	otel.SetErrorHandler(otel.ErrorHandlerFunc(func(err error) { tlog.Warn().Err(err).Msg("tracing") }))

	gate := &dropGate{max: int64(queue), full: m.SpansDropped.WithLabelValues("queue_full")}
	bsp := sdktrace.NewBatchSpanProcessor(&countingExporter{SpanExporter: exp, gate: gate, failed: m.SpansDropped.WithLabelValues("export_failed")},
		sdktrace.WithMaxQueueSize(queue)) // never blocking: the gate drops first
	gate.SpanProcessor = bsp
	// The sampler comes from OTEL_TRACES_SAMPLER(_ARG), the batching from OTEL_BSP_*.
	tp := sdktrace.NewTracerProvider(sdktrace.WithResource(res), sdktrace.WithSpanProcessor(gate))
	tlog.Info().Str("exporter", cmp.Or(exporter, "otlp")).Str("endpoint", endpoint).Str("protocol", protocol).Int("queue", queue).
		Strs("propagators", prop.Fields()).Msg("tracing on: one span per event")
	return tp, prop, func() {
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), tracingShutdownTimeout)
		defer cancel()
		if err := tp.Shutdown(sctx); err != nil {
			tlog.Warn().Err(err).Msg("tracing: export the last spans")
		}
	}, nil
}

// propagatorFromEnv is the propagator OTEL_PROPAGATORS names (autoprop:
// tracecontext, baggage, b3, b3multi, jaeger, xray, ottrace, none), W3C
// trace context and baggage when it is unset.
func propagatorFromEnv(getenv func(string) string) (propagation.TextMapPropagator, error) {
	v := getenv("OTEL_PROPAGATORS")
	if v == "" {
		return autoprop.NewTextMapPropagator(), nil
	}
	prop, err := autoprop.TextMapPropagator(strings.Split(v, ",")...)
	if err != nil {
		return nil, fmt.Errorf("OTEL_PROPAGATORS = %q: %v; fix: a comma-separated list of tracecontext (the default, with baggage), baggage, b3, b3multi, jaeger, xray, ottrace, or none", v, err)
	}
	return prop, nil
}

// checkSampler checks OTEL_TRACES_SAMPLER(_ARG), which the SDK would
// otherwise replace by its default with only a log line.
func checkSampler(getenv func(string) string) []error {
	s := getenv("OTEL_TRACES_SAMPLER")
	switch s {
	case "", "always_on", "always_off", "parentbased_always_on", "parentbased_always_off":
		return nil
	case "traceidratio", "parentbased_traceidratio":
		arg := getenv("OTEL_TRACES_SAMPLER_ARG")
		if arg == "" {
			return nil // 1.0
		}
		if r, err := strconv.ParseFloat(arg, 64); err != nil || r < 0 || r > 1 {
			return []error{fmt.Errorf("OTEL_TRACES_SAMPLER_ARG = %q: not a ratio in [0, 1]; fix: give e.g. 0.1", arg)}
		}
		return nil
	}
	return []error{fmt.Errorf("OTEL_TRACES_SAMPLER = %q: not a sampler jetbox knows; fix: use parentbased_always_on (the default), parentbased_traceidratio, traceidratio, always_on, always_off or parentbased_always_off", s)}
}

// dropGate hands sampled spans to the batch processor while fewer than max
// are queued or batched there, and counts (and drops) the others. The
// SDK's own drop on a full queue is silent (its counter is internal), so
// the gate drops first: the batch processor never finds its queue of max
// full, and span.End never waits.
type dropGate struct {
	sdktrace.SpanProcessor // the batch processor
	max                    int64
	queued                 atomic.Int64 // given to it, not yet to the exporter
	full                   prometheus.Counter
}

func (g *dropGate) OnEnd(s sdktrace.ReadOnlySpan) {
	if !s.SpanContext().IsSampled() {
		return // the batch processor ignores them too
	}
	if g.queued.Add(1) > g.max {
		g.queued.Add(-1)
		g.full.Inc()
		return
	}
	g.SpanProcessor.OnEnd(s)
}

// countingExporter tells the gate which spans left the batch processor,
// and counts the spans of failed exports (after the exporter's retries).
type countingExporter struct {
	sdktrace.SpanExporter
	gate   *dropGate
	failed prometheus.Counter
}

func (e *countingExporter) ExportSpans(ctx context.Context, spans []sdktrace.ReadOnlySpan) error {
	e.gate.queued.Add(-int64(len(spans)))
	err := e.SpanExporter.ExportSpans(ctx, spans)
	if err != nil {
		e.failed.Add(float64(len(spans)))
	}
	return err
}
