package main

import (
	"compress/gzip"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jetbox-dev/jetbox/sink"
	coltracepb "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	"google.golang.org/protobuf/proto"
)

// otlpReceiver is an OTLP/HTTP trace receiver in the bench: it decodes and
// counts the spans jetbox exports and, while collecting, keeps each span's
// start and end by message id (the outbox id).
type otlpReceiver struct {
	srv   *http.Server
	addr  string
	spans atomic.Int64

	mu      sync.Mutex
	collect bool
	byID    map[string]spanTimes
}

// spanTimes are a publish span's walsender send time (its attribute), start
// (jetbox read the row's XLogData) and end (JetStream's ack arrived).
type spanTimes struct{ walSent, start, end time.Time }

// startOTLPReceiver listens on a free loopback port; collect keeps the spans' times.
func startOTLPReceiver(collect bool) (*otlpReceiver, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("OTLP receiver: %w", err)
	}
	r := &otlpReceiver{addr: l.Addr().String(), collect: collect, byID: map[string]spanTimes{}}
	r.srv = &http.Server{Handler: http.HandlerFunc(r.serve)}
	go func() { _ = r.srv.Serve(l) }()
	return r, nil
}

// env points jetbox's tracing at the receiver, every event sampled, spans
// exported every 100 ms from a queue that holds a few seconds of them.
func (r *otlpReceiver) env() []string {
	return []string{"OTEL_EXPORTER_OTLP_ENDPOINT=http://" + r.addr, "OTEL_TRACES_SAMPLER=always_on",
		"OTEL_BSP_SCHEDULE_DELAY=100", "OTEL_BSP_MAX_QUEUE_SIZE=131072"}
}

func (r *otlpReceiver) serve(w http.ResponseWriter, req *http.Request) {
	var body io.Reader = req.Body
	if req.Header.Get("Content-Encoding") == "gzip" {
		gz, err := gzip.NewReader(req.Body)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		body = gz
	}
	data, err := io.ReadAll(body)
	var export coltracepb.ExportTraceServiceRequest
	if err == nil {
		err = proto.Unmarshal(data, &export)
	}
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	r.mu.Lock()
	for _, rs := range export.ResourceSpans {
		for _, ss := range rs.ScopeSpans {
			r.spans.Add(int64(len(ss.Spans)))
			if !r.collect {
				continue
			}
			for _, sp := range ss.Spans {
				t := spanTimes{start: time.Unix(0, int64(sp.StartTimeUnixNano)), end: time.Unix(0, int64(sp.EndTimeUnixNano))}
				id := ""
				for _, a := range sp.Attributes {
					switch a.Key {
					case "messaging.message.id":
						id = a.Value.GetStringValue()
					case string(sink.AttrWALSent):
						t.walSent = time.Unix(0, a.Value.GetIntValue())
					}
				}
				if id != "" {
					r.byID[id] = t
				}
			}
		}
	}
	r.mu.Unlock()
	out, _ := proto.Marshal(&coltracepb.ExportTraceServiceResponse{})
	w.Header().Set("Content-Type", "application/x-protobuf")
	_, _ = w.Write(out)
}

// take waits (up to timeout) until the spans of every id arrived, then
// returns and forgets them; ids whose span never came are missing from it.
func (r *otlpReceiver) take(ctx context.Context, ids []string, timeout time.Duration) map[string]spanTimes {
	deadline := time.Now().Add(timeout)
	for {
		r.mu.Lock()
		missing := 0
		for _, id := range ids {
			if _, ok := r.byID[id]; !ok {
				missing++
			}
		}
		if missing == 0 || time.Now().After(deadline) || ctx.Err() != nil {
			out := r.byID
			r.byID = map[string]spanTimes{}
			r.mu.Unlock()
			return out
		}
		r.mu.Unlock()
		select {
		case <-ctx.Done():
		case <-time.After(20 * time.Millisecond):
		}
	}
}

func (r *otlpReceiver) close() { _ = r.srv.Close() }

// tracedCatchup repeats the exactly-once catch-up with OpenTelemetry tracing on:
// every event sampled (OTEL_TRACES_SAMPLER=always_on), exported over
// OTLP/HTTP to a receiver in the bench that decodes and counts the spans.
// The note says how many arrived; the rest were dropped by jetbox's full
// export queue (jetbox_trace_spans_dropped_total), which never slows
// publishing.
func (b *bench) tracedCatchup(ctx context.Context) *throughput {
	rcv, err := startOTLPReceiver(false)
	if err != nil {
		return &throughput{Name: "jetbox, tracing on", Err: err}
	}
	defer rcv.close()
	opts := catchupOpts{env: []string{"OTEL_EXPORTER_OTLP_ENDPOINT=http://" + rcv.addr, "OTEL_TRACES_SAMPLER=always_on"}}
	res, _ := b.jetboxCatchup(ctx, "jetbox, --delivery=exactly-once, tracing on (every event sampled, OTLP/HTTP)", newDeployment("traced", "exactly-once"),
		b.cfg.Rows, b.cfg.TxRows, opts)
	// jetbox exported what its queue held at its stop.
	n := rcv.spans.Load()
	res.Note = fmt.Sprintf("%d spans exported of %d events", n, res.Events)
	if res.Err == nil && n == 0 {
		res.Err = errors.New("no span arrived at the OTLP receiver")
	}
	return res
}
