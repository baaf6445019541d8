package main

import (
	"compress/gzip"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"sync/atomic"

	coltracepb "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	"google.golang.org/protobuf/proto"
)

// tracedCatchup repeats the exactly-once catch-up with OpenTelemetry tracing on:
// every event sampled (OTEL_TRACES_SAMPLER=always_on), exported over
// OTLP/HTTP to a receiver in the bench that decodes and counts the spans.
// The note says how many arrived; the rest were dropped by jetbox's full
// export queue (jetbox_trace_spans_dropped_total), which never slows
// publishing.
func (b *bench) tracedCatchup(ctx context.Context) *throughput {
	var spans atomic.Int64
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return &throughput{Name: "jetbox, tracing on", Err: fmt.Errorf("OTLP receiver: %w", err)}
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var body io.Reader = r.Body
		if r.Header.Get("Content-Encoding") == "gzip" {
			gz, err := gzip.NewReader(r.Body)
			if err != nil {
				http.Error(w, err.Error(), http.StatusBadRequest)
				return
			}
			body = gz
		}
		data, err := io.ReadAll(body)
		var req coltracepb.ExportTraceServiceRequest
		if err == nil {
			err = proto.Unmarshal(data, &req)
		}
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		for _, rs := range req.ResourceSpans {
			for _, ss := range rs.ScopeSpans {
				spans.Add(int64(len(ss.Spans)))
			}
		}
		out, _ := proto.Marshal(&coltracepb.ExportTraceServiceResponse{})
		w.Header().Set("Content-Type", "application/x-protobuf")
		_, _ = w.Write(out)
	})}
	go func() { _ = srv.Serve(l) }()
	defer srv.Close()
	opts := catchupOpts{env: []string{"OTEL_EXPORTER_OTLP_ENDPOINT=http://" + l.Addr().String(), "OTEL_TRACES_SAMPLER=always_on"}}
	res, _ := b.jetboxCatchup(ctx, "jetbox, --delivery=exactly-once, tracing on (every event sampled, OTLP/HTTP)", newDeployment("traced", "exactly-once"),
		b.cfg.Rows, b.cfg.TxRows, opts)
	// jetbox exported what its queue held at its stop.
	n := spans.Load()
	res.Note = fmt.Sprintf("%d spans exported of %d events", n, res.Events)
	if res.Err == nil && n == 0 {
		res.Err = errors.New("no span arrived at the OTLP receiver")
	}
	return res
}
