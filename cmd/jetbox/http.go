package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jetbox-dev/jetbox/internal/metrics"
	"github.com/jetbox-dev/jetbox/replication"
	"github.com/jetbox-dev/jetbox/sink"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/rs/zerolog"
)

// opsServer serves /metrics, /healthz and /readyz.
type opsServer struct {
	srv      *http.Server
	ln       net.Listener
	streamer atomic.Pointer[replication.Streamer]
	nats     atomic.Pointer[sink.Publisher] // /healthz fails once its connection is CLOSED
	audit    atomic.Pointer[auditLoop]      // the continuous audit's warning, if on
	slots    atomic.Pointer[slotWatch]      // the standbys' copies of the slot (--standby-urls)

	scrapeMu sync.Mutex
	scraped  chan struct{} // closed by the next /metrics response (countThenArm)
}

// readiness is the /readyz body.
type readiness struct {
	Ready            bool     `json:"ready"`
	State            string   `json:"state"`
	ConfirmedLSN     string   `json:"confirmed_lsn,omitempty"`
	LagBytes         int64    `json:"lag_bytes"`
	RetainedWALBytes int64    `json:"retained_wal_bytes"`
	WALStatus        string   `json:"wal_status,omitempty"`
	Warnings         []string `json:"warnings,omitempty"`
}

// startOps listens on addr ("" disables it) and serves in the background.
func startOps(addr string, m *metrics.Metrics, log zerolog.Logger) (*opsServer, error) {
	if addr == "" {
		return nil, nil
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("listen on --http-addr %s: %w (is another jetbox using it? give each instance its own address)", addr, err)
	}
	o := &opsServer{ln: ln}
	mux := http.NewServeMux()
	metricsHandler := promhttp.HandlerFor(m.Registry, promhttp.HandlerOpts{})
	o.scraped = make(chan struct{})
	mux.HandleFunc("GET /metrics", func(w http.ResponseWriter, r *http.Request) {
		o.scrapeMu.Lock() // a scrape begun before countThenArm may not count
		done := o.scraped
		metricsHandler.ServeHTTP(w, r)
		o.scrapeMu.Unlock()
		select {
		case <-done:
		default:
			close(done)
		}
	})
	mux.HandleFunc("GET /healthz", o.health)
	mux.HandleFunc("GET /readyz", o.ready)
	o.srv = &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go func() {
		if err := o.srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			log.Error().Err(err).Msg("http server")
		}
	}()
	log.Info().Str("addr", ln.Addr().String()).Msg("serving /metrics, /healthz, /readyz")
	return o, nil
}

// health is /healthz: 200 unless jetbox can make no progress any more (the
// NATS connection is CLOSED: jetbox is stopping, see run).
func (o *opsServer) health(w http.ResponseWriter, _ *http.Request) {
	w.Header().Set("Content-Type", "text/plain")
	if p := o.nats.Load(); p != nil {
		if err := p.ClosedError(); err != nil {
			w.WriteHeader(http.StatusServiceUnavailable)
			_, _ = fmt.Fprintf(w, "%v\n", err)
			return
		}
	}
	_, _ = w.Write([]byte("ok\n"))
}

// ready is /readyz: 200 while jetbox streams and publishes. With ?standby=1
// also while it stands by (another instance holds the slot: Postgres
// answered) with its NATS connection up: the readiness of an instance that
// is one of several on a slot (Kubernetes rolling updates, disruption
// budgets), which a standby that cannot reach NATS fails.
func (o *opsServer) ready(w http.ResponseWriter, req *http.Request) {
	standbyOK, _ := strconv.ParseBool(req.URL.Query().Get("standby"))
	r := readiness{State: replication.StateStarting}
	if s := o.streamer.Load(); s != nil {
		st := s.SlotStats()
		ready := s.Ready() || (standbyOK && s.State() == replication.StateStandby && o.natsConnected())
		r = readiness{Ready: ready, State: s.State(), ConfirmedLSN: s.ConfirmedLSN().String(),
			LagBytes: st.LagBytes, RetainedWALBytes: st.RetainedBytes, WALStatus: st.WALStatus}
		if st.OverThreshold {
			r.Warnings = append(r.Warnings, fmt.Sprintf("the slot retains %d bytes of WAL, above --max-retained-wal", st.RetainedBytes))
		}
		if st.Err != "" {
			r.Warnings = append(r.Warnings, "slot monitor: "+st.Err)
		}
		if w := o.audit.Load().Warning(); w != "" {
			r.Warnings = append(r.Warnings, w)
		}
		r.Warnings = append(r.Warnings, o.slots.Load().Warnings()...)
		r.Warnings = append(r.Warnings, standbySlotWarnings(s.StandbySlots())...)
	}
	w.Header().Set("Content-Type", "application/json")
	if !r.Ready {
		w.WriteHeader(http.StatusServiceUnavailable)
	}
	_ = json.NewEncoder(w).Encode(r)
}

// standbySlotWarnings are /readyz's warnings of --wait-for-standby-slots.
func standbySlotWarnings(st replication.StandbySlotState) []string {
	var w []string
	switch {
	case st.Waiting:
		w = append(w, fmt.Sprintf("publishing waits for the standbys (--wait-for-standby-slots) since %s, longer than --standby-slot-timeout",
			st.WaitingSince.UTC().Format(time.RFC3339)))
	case st.Unguarded:
		w = append(w, "publishing without waiting for the standbys (--on-standby-slot-timeout=publish): a failover may leave events whose rows the promoted standby lacks")
	default:
		return nil
	}
	for _, b := range st.Behind {
		w = append(w, "standby slot: "+b)
	}
	return w
}

// natsConnected reports whether the NATS connection is up now.
func (o *opsServer) natsConnected() bool {
	p := o.nats.Load()
	return p != nil && p.Connected()
}

// countThenArm runs count (the stop's last counts) and arms a wait for the
// next /metrics response, with no scrape in between: a response begun
// before holds neither, one begun after holds the counts and ends the wait
// (awaitScrape). jetbox stopping on an invalid row waits so, else its last
// counts would leave with the process, never scraped. Without a server it
// only counts, and returns nil.
func (o *opsServer) countThenArm(count func()) <-chan struct{} {
	if o == nil {
		count()
		return nil
	}
	o.scrapeMu.Lock()
	defer o.scrapeMu.Unlock()
	count()
	o.scraped = make(chan struct{})
	return o.scraped
}

// awaitScrape returns true once next (from countThenArm) is closed, false after
// wait or when ctx ends.
func awaitScrape(ctx context.Context, next <-chan struct{}, wait time.Duration) bool {
	if next == nil || wait <= 0 {
		return false
	}
	t := time.NewTimer(wait)
	defer t.Stop()
	select {
	case <-next:
		return true
	case <-t.C:
	case <-ctx.Done():
	}
	return false
}

func (o *opsServer) close() {
	if o == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	_ = o.srv.Shutdown(ctx)
}

// healthcheckCmd is `jetbox healthcheck`: for container HEALTHCHECKs in
// images without curl. It exits 0 when /healthz answers 200.
type healthcheckCmd struct {
	HTTPAddr string `name:"http-addr" env:"JETBOX_HTTP_ADDR" default:"127.0.0.1:8080" help:"jetbox's --http-addr."`
	Ready    bool   `help:"Check /readyz instead of /healthz."`
}

func (h *healthcheckCmd) run() int {
	path := "/healthz"
	if h.Ready {
		path = "/readyz"
	}
	c := http.Client{Timeout: 3 * time.Second}
	resp, err := c.Get("http://" + h.HTTPAddr + path)
	if err != nil {
		return exitFailure
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return exitFailure
	}
	return exitOK
}
