package replication

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"sync/atomic"
	"time"

	"github.com/cenkalti/backoff/v5"
	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"
	"github.com/jetbox-dev/jetbox/decoder"
	"github.com/jetbox-dev/jetbox/internal/metrics"
	"github.com/rs/zerolog"
)

// Config configures replication.
type Config struct {
	Slot        string
	Publication string
	Decoder     decoder.Config
	// StampDecoded sets each event's Decoded time (for its trace span).
	StampDecoded bool

	StatusInterval   time.Duration // how often to send standby status (≤ wal_sender_timeout/3)
	Timeout          time.Duration // no message from Postgres for this long while reading: reconnect
	MaxInFlight      int           // events published but not yet acked
	MaxInFlightBytes int           // payload bytes published but not yet acked (0: no bound)
	ShutdownTimeout  time.Duration // how long a stop waits for in-flight acks
	MaxBackoff       time.Duration // longest wait between reconnects
	StandbyRetry     time.Duration // how often a standby retries the slot (another instance holds it)

	HeartbeatInterval time.Duration // 0: no heartbeats
	MonitorInterval   time.Duration // how often to read the slot's lag and retained WAL (< 0: no monitor)
	MaxRetainedWAL    int64         // warn above this many retained WAL bytes; 0: off
	Metrics           *metrics.Metrics

	// AcceptLostRows: go on (with a warning) where the server does not
	// continue the stream's history (see VerifyHistory) instead of stopping.
	AcceptLostRows bool
	// AutoRepair: jetbox run repairs a lost slot itself (--on-lost-slot=repair):
	// check reports an invalidated slot and an unfinished repair's marker as
	// warnings, since the run that finds them repairs (or waits for the
	// repair) instead of stopping.
	AutoRepair bool
	// AllowRoutingChange: go on (with a warning) under another subject
	// template or partition count than the stream's last message was
	// routed under (see checkRouting) instead of stopping.
	AllowRoutingChange bool
	// PrimaryURL, when the server is a hot standby (PostgreSQL 16+), is its
	// primary's URL (same database): for what a standby cannot do, creating
	// the publication, heartbeats and standby snapshots while the slot is
	// created (--primary-url). Empty: none of these.
	PrimaryURL string
	// CreatedAtColumn is the insert-time column jetbox repair and jetbox
	// audit page the outbox by (check says when no index leads with it).
	CreatedAtColumn string
	// StandbySlots: publish a transaction only once these standbys'
	// physical slots flushed it (--wait-for-standby-slots).
	StandbySlots StandbySlotsConfig
}

func (c Config) qualifiedTable() string { return c.Decoder.Schema + "." + c.Decoder.Table }
func (c Config) quotedTable() string {
	return pgx.Identifier{c.Decoder.Schema, c.Decoder.Table}.Sanitize()
}

// Streamer runs replication sessions, reconnecting with backoff.
type Streamer struct {
	cfg        Config
	connString string
	connCfg    *pgconn.Config
	sink       Sink
	log        zerolog.Logger
	sent       atomic.Uint64 // last LSN confirmed to Postgres
	state      atomic.Value  // string, one of the State* names
	mon        *monitor
	fatal      chan error // the monitor found a reason to stop
	restart    chan error // the monitor found a reason to reconnect (a promotion)
	// outbox is which table the outbox is, read at the first session (only
	// the Run goroutine touches it); startOID is its OID, for the monitor
	// (0 until then).
	outbox   decoder.OutboxIdentity
	startOID atomic.Uint32
	// forgotTip: the sequence of a tip whose replay did not reproduce it
	// and whose loss --accept-lost-rows accepted (only Run's goroutine).
	forgotTip uint64
	// member is the outbox's membership in the publication read by the
	// first session (nil until then), for later sessions and the monitor.
	member atomic.Pointer[membership]
	// standbySlots is the --wait-for-standby-slots gate's state (nil: none).
	standbySlots atomic.Pointer[StandbySlotState]
}

// New returns a streamer for the database at connString.
func New(connString string, cfg Config, sink Sink, log zerolog.Logger) (*Streamer, error) {
	cc, err := replicationConfig(connString)
	if err != nil {
		return nil, err
	}
	if cfg.StatusInterval <= 0 {
		cfg.StatusInterval = DefaultStatusInterval
	}
	if cfg.Timeout <= 0 {
		cfg.Timeout = DefaultTimeout
	}
	if cfg.ShutdownTimeout <= 0 {
		cfg.ShutdownTimeout = DefaultShutdownTimeout
	}
	if cfg.MaxBackoff <= 0 {
		cfg.MaxBackoff = DefaultMaxBackoff
	}
	if cfg.StandbyRetry <= 0 {
		cfg.StandbyRetry = DefaultStandbyRetry
	}
	if cfg.MonitorInterval == 0 {
		cfg.MonitorInterval = DefaultMonitorInterval
	}
	if cfg.Metrics == nil {
		cfg.Metrics = metrics.New()
	}
	if cfg.StandbySlots.Timeout <= 0 {
		cfg.StandbySlots.Timeout = DefaultStandbySlotTimeout
	}
	if cfg.StandbySlots.OnTimeout == "" {
		cfg.StandbySlots.OnTimeout = StandbySlotWait
	}
	cfg.Metrics.DeclareStates(States())
	if cc.ConnectTimeout == 0 {
		cc.ConnectTimeout = cfg.Timeout
	}
	s := &Streamer{cfg: cfg, connString: connString, connCfg: cc, sink: sink,
		log: log.With().Str("component", "replication").Str("slot", cfg.Slot).Logger()}
	s.mon = &monitor{s: s, published: time.Now()}
	s.fatal = make(chan error, 1)
	s.restart = make(chan error, 1)
	s.setState(StateStarting)
	return s, nil
}

// replicationConfig is the walsender connection's configuration.
func replicationConfig(connString string) (*pgconn.Config, error) {
	cc, err := pgconn.ParseConfig(connString)
	if err != nil {
		return nil, fmt.Errorf("parse postgres URL: %w", err)
	}
	// The walsender streams faster than jetbox reads in a catch-up: read
	// what the socket holds in one syscall, not pgx's 8 KiB at a time.
	cc.BuildFrontend = func(r io.Reader, w io.Writer) *pgproto3.Frontend {
		return pgproto3.NewFrontend(bufio.NewReaderSize(r, walReadBuffer), w)
	}
	cc.RuntimeParams["replication"] = "database"
	cc.RuntimeParams["application_name"] = "jetbox"
	// Text output depends on the walsender session's settings: pin them.
	for k, v := range pinnedParams {
		cc.RuntimeParams[k] = v
	}
	return cc, nil
}

// walReadBuffer is the read buffer of the walsender connection.
const walReadBuffer = 64 << 10

// pinnedParams fix the text output of values, for the walsender and for the
// repair's snapshot connections alike.
var pinnedParams = map[string]string{"DateStyle": "ISO", "IntervalStyle": "postgres", "TimeZone": "UTC",
	"bytea_output": "hex", "extra_float_digits": "3", "client_encoding": "UTF8"}

func (s *Streamer) setState(state string) {
	if old, _ := s.state.Load().(string); old != state {
		s.state.Store(state)
		s.cfg.Metrics.SetState(state)
	}
}

// State returns the forwarder's state: starting, streaming, standby,
// reconnecting, republishing or stopped.
func (s *Streamer) State() string { st, _ := s.state.Load().(string); return st }

// Ready reports whether jetbox is streaming and publishing.
func (s *Streamer) Ready() bool { return s.State() == StateStreaming }

// SlotStats returns what the slot monitor last read.
func (s *Streamer) SlotStats() SlotStats { return s.mon.snapshot() }

// Run streams until ctx is cancelled (returns nil) or a permanent error
// occurs (returned). Transient errors reconnect with jittered backoff.
func (s *Streamer) Run(ctx context.Context) error {
	mctx, stopMonitor := context.WithCancel(ctx)
	monitorDone := make(chan struct{})
	go func() {
		defer close(monitorDone)
		if s.cfg.MonitorInterval > 0 {
			s.mon.run(mctx)
		}
	}()
	defer func() { stopMonitor(); <-monitorDone; s.setState(StateStopped) }()

	bo := backoff.NewExponentialBackOff()
	bo.InitialInterval = 200 * time.Millisecond
	bo.MaxInterval = s.cfg.MaxBackoff
	for attempt := 1; ; attempt++ {
		started := time.Now()
		err := s.replicate(ctx)
		if ctx.Err() != nil {
			return nil
		}
		if err == nil {
			err = errors.New("replication session ended")
		}
		if IsPermanent(err) {
			return err
		}
		var wait time.Duration
		if isSlotInUse(err) {
			// Another instance streams: stand by and take over when it goes.
			if s.State() != StateStandby {
				s.log.Info().Err(err).Stringer("retry", s.cfg.StandbyRetry).Msg("another instance holds the slot: standing by")
			}
			s.setState(StateStandby)
			bo.Reset()
			wait = s.cfg.StandbyRetry/2 + time.Duration(rand.Int64N(int64(s.cfg.StandbyRetry)))
		} else {
			if time.Since(started) > time.Minute {
				bo.Reset()
			}
			wait = bo.NextBackOff()
			s.setState(StateReconnecting)
			s.cfg.Metrics.Reconnects.WithLabelValues("postgres").Inc()
			s.log.Warn().Err(err).Int("attempt", attempt).Stringer("backoff", wait).Msg("replication session ended, reconnecting")
		}
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(wait):
		}
	}
}

// ConfirmedLSN returns the last LSN confirmed to Postgres.
func (s *Streamer) ConfirmedLSN() pglogrepl.LSN { return pglogrepl.LSN(s.sent.Load()) }
