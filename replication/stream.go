// Package replication owns the walsender connection: it starts logical
// replication on the slot, feeds pgoutput messages to the decoder, hands each
// event to the sink, and sends standby status updates whose flush position is
// the checkpoint tracker's safe LSN and nothing else.
//
// One goroutine does all I/O on the replication connection (pgconn is not safe
// for concurrent use). Status updates go out on a timer, at once when the
// server asks, and while the loop waits on a full publish window, so
// wal_sender_timeout never fires because JetStream is slow or down.
package replication

import (
	"context"
	"errors"
	"fmt"
	"github.com/jetbox-dev/jetbox/internal/fault"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/cenkalti/backoff/v5"
	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"
	"github.com/jetbox-dev/jetbox/checkpoint"
	"github.com/jetbox-dev/jetbox/decoder"
	"github.com/jetbox-dev/jetbox/internal/metrics"
	"github.com/rs/zerolog"
)

// Config configures replication.
type Config struct {
	Slot        string
	Publication string
	Decoder     decoder.Config

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
}

func (c Config) qualifiedTable() string { return c.Decoder.Schema + "." + c.Decoder.Table }
func (c Config) quotedTable() string {
	return pgx.Identifier{c.Decoder.Schema, c.Decoder.Table}.Sanitize()
}

// Sink is where events go: one Session per replication session, and a new
// one after publish failures. Open may fail (the stream is unreachable); an
// error that implements Permanent() true stops jetbox.
type Sink interface {
	// Open starts a session for events from source (see decoder.Event.Source).
	Open(ctx context.Context, source string) (Session, error)
}

// Session publishes the events of one replication session.
type Session interface {
	// Publish sends ev. done is called exactly once, with nil once JetStream
	// stored it, unless Close gave up waiting. A returned error means ev was
	// not sent and done will not be called.
	Publish(ev *decoder.Event, done func(error)) error
	// EndTransaction says the events published since the previous one
	// complete a transaction. A session that publishes whole transactions
	// as atomic batches holds a transaction's events until then.
	EndTransaction()
	// Flush is called when the window is full, before the loop waits for
	// room. blocked (safe for any goroutine) reports whether the loop still
	// waits with no room: a session holding events back sends them once
	// nothing else it sent can free the window, so the wait cannot deadlock.
	Flush(blocked func() bool)
	// Close waits (bounded by ctx) until every done was called.
	Close(ctx context.Context) error
}

// Streamer runs replication sessions, reconnecting with backoff.
type Streamer struct {
	cfg        Config
	connString string
	connCfg    *pgconn.Config
	sink       Sink
	log        zerolog.Logger
	sent       atomic.Uint64 // last LSN confirmed to Postgres
	state      atomic.Value  // string, one of metrics.State*
	mon        *monitor
	fatal      chan error // the monitor found a reason to stop
	// outbox is which table the outbox is, read at the first session (only
	// the Run goroutine touches it); startOID is its OID, for the monitor
	// (0 until then).
	outbox   decoder.OutboxIdentity
	startOID atomic.Uint32
}

// New returns a streamer for the database at connString.
func New(connString string, cfg Config, sink Sink, log zerolog.Logger) (*Streamer, error) {
	cc, err := replicationConfig(connString)
	if err != nil {
		return nil, err
	}
	if cfg.StatusInterval <= 0 {
		cfg.StatusInterval = time.Second
	}
	if cfg.Timeout <= 0 {
		cfg.Timeout = 30 * time.Second
	}
	if cfg.ShutdownTimeout <= 0 {
		cfg.ShutdownTimeout = 10 * time.Second
	}
	if cfg.MaxBackoff <= 0 {
		cfg.MaxBackoff = 30 * time.Second
	}
	if cfg.StandbyRetry <= 0 {
		cfg.StandbyRetry = time.Second
	}
	if cfg.MonitorInterval == 0 {
		cfg.MonitorInterval = 5 * time.Second
	}
	if cfg.Metrics == nil {
		cfg.Metrics = metrics.New()
	}
	if cc.ConnectTimeout == 0 {
		cc.ConnectTimeout = cfg.Timeout
	}
	s := &Streamer{cfg: cfg, connString: connString, connCfg: cc, sink: sink,
		log: log.With().Str("component", "replication").Str("slot", cfg.Slot).Logger()}
	s.mon = &monitor{s: s, published: time.Now()}
	s.fatal = make(chan error, 1)
	s.setState(metrics.StateStarting)
	return s, nil
}

// replicationConfig is the walsender connection's configuration.
func replicationConfig(connString string) (*pgconn.Config, error) {
	cc, err := pgconn.ParseConfig(connString)
	if err != nil {
		return nil, fmt.Errorf("parse postgres URL: %w", err)
	}
	cc.RuntimeParams["replication"] = "database"
	cc.RuntimeParams["application_name"] = "jetbox"
	// Text output depends on the walsender session's settings: pin them.
	for k, v := range map[string]string{"DateStyle": "ISO", "IntervalStyle": "postgres", "TimeZone": "UTC",
		"bytea_output": "hex", "extra_float_digits": "3", "client_encoding": "UTF8"} {
		cc.RuntimeParams[k] = v
	}
	return cc, nil
}

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
func (s *Streamer) Ready() bool { return s.State() == metrics.StateStreaming }

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
	defer func() { stopMonitor(); <-monitorDone; s.setState(metrics.StateStopped) }()

	bo := backoff.NewExponentialBackOff()
	bo.InitialInterval = 200 * time.Millisecond
	bo.MaxInterval = s.cfg.MaxBackoff
	for attempt := 1; ; attempt++ {
		started := time.Now()
		err := s.session(ctx)
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
			if s.State() != metrics.StateStandby {
				s.log.Info().Err(err).Dur("retry", s.cfg.StandbyRetry).Msg("another instance holds the slot: standing by")
			}
			s.setState(metrics.StateStandby)
			bo.Reset()
			wait = s.cfg.StandbyRetry/2 + time.Duration(rand.Int64N(int64(s.cfg.StandbyRetry)))
		} else {
			if time.Since(started) > time.Minute {
				bo.Reset()
			}
			wait = bo.NextBackOff()
			s.setState(metrics.StateReconnecting)
			s.cfg.Metrics.Reconnects.WithLabelValues("postgres").Inc()
			s.log.Warn().Err(err).Int("attempt", attempt).Dur("backoff", wait).Msg("replication session ended, reconnecting")
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

// PermanentError is an error retrying cannot fix; jetbox stops on it. Hint
// says what to do. It is jetbox's one shape of such an error (see
// internal/fault).
type PermanentError = fault.Permanent

// IsPermanent reports whether err should stop jetbox rather than reconnect.
func IsPermanent(err error) bool {
	var ie *decoder.InvalidEventError
	if fault.Is(err) || errors.As(err, &ie) || errors.Is(err, decoder.ErrProtocol) || errors.Is(err, decoder.ErrTableReplaced) {
		return true
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		switch pgErr.Code {
		case "42704", // slot or publication does not exist
			"28000", "28P01", // authentication
			"42501", // insufficient privilege
			"3D000": // database does not exist
			return true
		case "55000": // object not in prerequisite state: slot invalidated
			return strings.Contains(pgErr.Message, "can no longer get changes")
		}
	}
	return false
}

func isSlotInUse(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "55006"
}

// session is one replication connection from START_REPLICATION to its end.
func (s *Streamer) session(ctx context.Context) (err error) {
	// Bound the whole set-up: a blackholed network would hang it forever.
	sctx, cancel := context.WithTimeout(ctx, s.cfg.Timeout)
	defer cancel()
	conn, err := pgconn.ConnectConfig(sctx, s.connCfg)
	if err != nil {
		return fmt.Errorf("connect for replication: %w", err)
	}
	defer func() {
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Second)
		defer cancel()
		conn.Close(cctx)
	}()

	// Never start a new history silently: the server must continue the
	// stream's (slot kept, no rewind, a timeline that branched after it).
	ts, _ := s.sink.(TipSource)
	srv, err := checkHistory(sctx, conn, s.cfg, ts, s.log)
	if err != nil {
		return err
	}
	if err := s.checkOutboxOID(sctx, conn); err != nil {
		return err
	}
	sys := srv.sys
	start, err := slotPosition(sctx, conn, s.cfg.Slot)
	if err != nil {
		return err
	}
	source := sourceOf(sys, s.cfg.Slot)
	// Open the sink before streaming starts: no walsender waits on us yet.
	sess, err := s.sink.Open(sctx, source)
	if err != nil {
		return fmt.Errorf("open publishing session: %w", err)
	}
	args := []string{"proto_version '1'", "publication_names " + quoteLiteral(quoteIdent(s.cfg.Publication))}
	if s.cfg.Decoder.MessagePrefix != "" {
		args = append(args, "messages 'true'") // PostgreSQL 14+ (checked by Check)
	}
	// Start at 0/0: the server resumes from the slot's confirmed_flush_lsn.
	if err := pglogrepl.StartReplication(sctx, conn, quoteIdent(s.cfg.Slot), 0,
		pglogrepl.StartReplicationOptions{Mode: pglogrepl.LogicalReplication, PluginArgs: args}); err != nil {
		_ = sess.Close(context.WithoutCancel(ctx))
		return fmt.Errorf("start replication on slot %q: %w", s.cfg.Slot, err)
	}
	log := s.log.With().Str("publication", s.cfg.Publication).Logger()
	if s.State() == metrics.StateStandby {
		log.Info().Str("confirmed_lsn", start.String()).Msg("took over the slot")
	}
	log.Info().Str("confirmed_lsn", start.String()).Str("source", source).Msg("streaming")
	s.setState(metrics.StateStreaming)

	l := &loop{
		s:       s,
		conn:    conn,
		log:     log,
		tracker: checkpoint.New(start, s.cfg.MaxInFlight, s.cfg.MaxInFlightBytes),
		dec:     decoder.New(s.cfg.Decoder),
		sess:    sess,
		source:  source,
	}
	l.dec.SetOutbox(s.outbox)
	s.sent.Store(uint64(start))
	err = l.run(ctx)
	return l.finish(ctx, err)
}

// checkOutboxOID reads the outbox table's relation OID over the replication
// connection. The first session records it, with the WAL position it was
// read at, for the decoders and the monitor; a later session that finds
// another OID stops jetbox: the table was dropped and recreated meanwhile.
func (s *Streamer) checkOutboxOID(ctx context.Context, conn *pgconn.PgConn) error {
	if !s.cfg.hasTable() {
		return nil
	}
	table := s.cfg.quotedTable()
	res, err := conn.Exec(ctx, "SELECT coalesce(to_regclass("+quoteLiteral(table)+")::oid, 0)::text, pg_current_wal_lsn()::text").ReadAll()
	if err != nil {
		return fmt.Errorf("read the relation OID of %s: %w", s.cfg.qualifiedTable(), err)
	}
	if len(res) != 1 || len(res[0].Rows) != 1 {
		return fmt.Errorf("read the relation OID of %s: no row", s.cfg.qualifiedTable())
	}
	oid, err := strconv.ParseUint(string(res[0].Rows[0][0]), 10, 32)
	if err != nil {
		return fmt.Errorf("parse the relation OID of %s: %w", s.cfg.qualifiedTable(), err)
	}
	lsn, err := pglogrepl.ParseLSN(string(res[0].Rows[0][1]))
	if err != nil {
		return fmt.Errorf("parse pg_current_wal_lsn: %w", err)
	}
	switch first := s.outbox.OID; {
	case oid == 0: // dropped: the monitor and the publication check report it
	case first == 0:
		s.outbox = decoder.OutboxIdentity{OID: uint32(oid), LSN: lsn}
		s.startOID.Store(uint32(oid))
	case uint32(oid) != first:
		return &PermanentError{Err: s.replacedError(first, uint32(oid), "while jetbox was reconnecting")}
	}
	return nil
}

// replacedError explains an outbox table dropped and recreated under jetbox.
func (s *Streamer) replacedError(was, now uint32, when string) error {
	t := s.cfg.qualifiedTable()
	return fmt.Errorf("%w: table %s was dropped and recreated %s (relation OID %d at start, now %d): Postgres streams a new table only from the moment it is added to publication %q, so rows inserted into it before then were never streamed, and jetbox stops rather than lose them silently; "+
		"fix: re-insert, with their ids, the rows of %s committed before it was added to the publication again (the stream dedups those it has), then restart jetbox",
		decoder.ErrTableReplaced, t, when, was, now, s.cfg.Publication, t)
}

// slotPosition reads the slot's confirmed_flush_lsn over the replication
// connection (walsenders in database mode accept simple SQL).
func slotPosition(ctx context.Context, conn *pgconn.PgConn, slot string) (pglogrepl.LSN, error) {
	res, err := conn.Exec(ctx, "SELECT coalesce(confirmed_flush_lsn::text, '0/0') FROM pg_replication_slots WHERE slot_name = "+quoteLiteral(slot)).ReadAll()
	if err != nil {
		return 0, fmt.Errorf("read slot %q: %w", slot, err)
	}
	if len(res) != 1 || len(res[0].Rows) == 0 {
		return 0, &PermanentError{Err: fmt.Errorf("replication slot %q does not exist (dropped while jetbox ran?): rows committed since it was dropped cannot be streamed; re-publish them from the table, then restart jetbox, which creates a new slot", slot)}
	}
	lsn, err := pglogrepl.ParseLSN(string(res[0].Rows[0][0]))
	if err != nil {
		return 0, fmt.Errorf("parse confirmed_flush_lsn of slot %q: %w", slot, err)
	}
	return lsn, nil
}

func quoteIdent(s string) string   { return `"` + strings.ReplaceAll(s, `"`, `""`) + `"` }
func quoteLiteral(s string) string { return `'` + strings.ReplaceAll(s, `'`, `''`) + `'` }

// loop is the state of one session's receive loop. Only its goroutine touches conn.
type loop struct {
	s       *Streamer
	conn    *pgconn.PgConn
	log     zerolog.Logger
	tracker *checkpoint.Tracker
	dec     *decoder.Decoder
	sess    Session
	source  string

	nextStatus time.Time
	deadline   time.Time // read deadline currently set on the socket
	lastRecv   time.Time
	sent       pglogrepl.LSN
	txLSN      pglogrepl.LSN // commit LSN of the transaction being read, once it has events; 0 otherwise
}

func (l *loop) run(ctx context.Context) error {
	netConn := l.conn.Conn()
	// Wake a blocked read when ctx ends.
	stop := context.AfterFunc(ctx, func() { _ = netConn.SetReadDeadline(time.Now()) })
	defer stop()
	defer func() { _ = netConn.SetReadDeadline(time.Time{}) }()

	l.lastRecv = time.Now()
	if err := l.sendStatus(true); err != nil {
		return err
	}
	for {
		if n, err := l.tracker.Failures(); n > 0 {
			if err := l.republish(ctx, n, err); err != nil {
				return err
			}
		}
		now := time.Now()
		if !now.Before(l.nextStatus) {
			if err := l.sendStatus(true); err != nil {
				return err
			}
		}
		if !l.deadline.Equal(l.nextStatus) {
			l.deadline = l.nextStatus
			if err := netConn.SetReadDeadline(l.deadline); err != nil {
				return fmt.Errorf("set read deadline: %w", err)
			}
		}
		if ctx.Err() != nil {
			return nil
		}
		select {
		case err := <-l.s.fatal:
			return err
		default:
		}
		msg, err := l.conn.ReceiveMessage(context.Background())
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			if pgconn.Timeout(err) {
				l.deadline = time.Time{} // the socket may hold a deadline in the past
				if since := time.Since(l.lastRecv); since > l.s.cfg.Timeout {
					return fmt.Errorf("no message from postgres for %s (network cut or half-open connection): reconnecting", since.Round(time.Second))
				}
				continue
			}
			return fmt.Errorf("receive replication message: %w", err)
		}
		l.lastRecv = time.Now()
		switch m := msg.(type) {
		case *pgproto3.CopyData:
			if err := l.handle(ctx, m.Data); err != nil {
				return err
			}
		case *pgproto3.ErrorResponse:
			return pgconn.ErrorResponseToPgError(m)
		case *pgproto3.NoticeResponse:
			l.log.Warn().Str("notice", m.Message).Msg("postgres notice")
		case *pgproto3.ParameterStatus:
		default:
			return fmt.Errorf("replication stream ended by the server (%T)", msg)
		}
	}
}

func (l *loop) handle(ctx context.Context, data []byte) error {
	if len(data) == 0 {
		return fmt.Errorf("%w: empty CopyData", decoder.ErrProtocol)
	}
	switch data[0] {
	case pglogrepl.PrimaryKeepaliveMessageByteID:
		ka, err := pglogrepl.ParsePrimaryKeepaliveMessage(data[1:])
		if err != nil {
			return fmt.Errorf("%w: %v", decoder.ErrProtocol, err)
		}
		// Idle: nothing in flight and no open transaction, so every change up
		// to the server's position was either published or not an outbox row.
		if !l.dec.InTransaction() {
			l.tracker.AdvanceIdle(ka.ServerWALEnd)
		}
		if ka.ReplyRequested {
			return l.sendStatus(false)
		}
		return nil
	case pglogrepl.XLogDataByteID:
		xld, err := pglogrepl.ParseXLogData(data[1:])
		if err != nil {
			return fmt.Errorf("%w: %v", decoder.ErrProtocol, err)
		}
		msg, err := l.dec.Decode(xld.WALData)
		if err != nil {
			return err
		}
		switch msg.Kind {
		case decoder.KindEvent:
			msg.Event.Source = l.source
			if msg.Event.DeadLetter != nil {
				l.deadLettered(msg.Event.DeadLetter, msg.Event.Subject)
			}
			l.txLSN = msg.Event.CommitLSN
			return l.publish(ctx, &msg.Event)
		case decoder.KindCommit:
			l.tracker.Commit(msg.EndLSN)
			l.sess.EndTransaction()
			l.txLSN = 0
			l.s.cfg.Metrics.Transactions.Inc()
		case decoder.KindNone:
			if msg.Ignored != "" {
				l.s.cfg.Metrics.IgnoredMessages.WithLabelValues(msg.Ignored).Inc()
			}
		}
		return nil
	default:
		return fmt.Errorf("%w: unknown CopyData message %q", decoder.ErrProtocol, data[0])
	}
}

// publish tracks ev, waiting for room in the window while keeping status
// updates flowing, then hands it to the sink.
func (l *loop) publish(ctx context.Context, ev *decoder.Event) error {
	size := len(ev.Payload) + 256
	if ticket, ok, err := l.tracker.TryAdd(size, ev); ok || err != nil {
		if ok {
			l.send(ticket, ev)
		}
		return err
	}
	for {
		l.sess.Flush(l.tracker.Blocked) // the window is full
		wctx, cancel := context.WithDeadline(ctx, l.nextStatus)
		ticket, err := l.tracker.Add(wctx, size, ev)
		cancel()
		switch {
		case err == nil:
			l.send(ticket, ev)
			return nil
		case ctx.Err() != nil:
			return ctx.Err()
		case errors.Is(err, checkpoint.ErrFailures):
			n, cause := l.tracker.Failures()
			if err := l.republish(ctx, n, cause); err != nil {
				return err
			}
		case errors.Is(err, context.DeadlineExceeded):
			if err := l.sendStatus(false); err != nil {
				return err
			}
		default:
			return err
		}
		l.lastRecv = time.Now() // not reading while blocked: not a sign of a dead server
	}
}

// send publishes one tracked event; every outcome resolves its ticket.
func (l *loop) send(ticket checkpoint.Ticket, ev *decoder.Event) {
	id, lsn := ev.ID, ev.CommitLSN
	wrap := func(err error) error { return fmt.Errorf("publish id=%s (transaction %s): %w", id, lsn, err) }
	err := l.sess.Publish(ev, func(err error) {
		if err == nil {
			l.tracker.Done(ticket)
		} else {
			l.tracker.Fail(ticket, wrap(err))
		}
	})
	if err != nil {
		l.tracker.Fail(ticket, wrap(err))
	}
}

var errAbandoned = errors.New("no PubAck before the publish session was abandoned")

// deadLetterable returns the invalid-row error in err when dead-lettering
// is on and a dead letter may replace the row.
func (l *loop) deadLetterable(err error) *decoder.InvalidEventError {
	var ie *decoder.InvalidEventError
	if l.s.cfg.Decoder.DeadLetterSubject != "" && errors.As(err, &ie) && ie.DeadLetterable() {
		return ie
	}
	return nil
}

func (l *loop) deadLettered(cause *decoder.InvalidEventError, subject string) {
	l.s.cfg.Metrics.InvalidRows.WithLabelValues(cause.Code, "dead-letter").Inc()
	l.log.Warn().Str("event_id", cause.ID).Str("lsn", cause.LSN.String()).Int("tx_index", cause.TxIndex).
		Str("reason", cause.Code).Str("dead_letter_subject", subject).Str("error", cause.Error()).
		Msg("outbox row cannot be published: sending a dead letter instead")
}

// republish recovers from failed publishes without dropping the replication
// connection: it stops reading, lets every in-flight publish resolve, then
// publishes the failed events again, in window order, with backoff, until
// all are stored. Status updates keep flowing meanwhile (confirming only what
// is safe), so a long NATS outage costs no reconnect and no re-decoding.
func (l *loop) republish(ctx context.Context, failed int, cause error) error {
	bo := backoff.NewExponentialBackOff()
	bo.InitialInterval = 200 * time.Millisecond
	bo.MaxInterval = l.s.cfg.MaxBackoff
	for attempt := 1; ; attempt++ {
		if IsPermanent(cause) && l.deadLetterable(cause) == nil {
			return cause
		}
		l.s.setState(metrics.StateRepublishing)
		// The sink's publish timeout bounds the wait; the cap guards against a
		// client that never resolves a future.
		if err := l.closeSession(ctx, 2*time.Minute); err != nil {
			return err
		}
		wait := bo.NextBackOff()
		l.log.Warn().Err(cause).Int("failed", failed).Int("attempt", attempt).Dur("backoff", wait).
			Msg("publish failed: republishing from the first unacked event, in order")
		if err := l.idle(ctx, time.Now().Add(wait)); err != nil {
			return err
		}
		sess, err := l.openSession(ctx)
		if err != nil {
			if IsPermanent(err) || ctx.Err() != nil {
				return err
			}
			cause = fmt.Errorf("open publishing session: %w", err)
			continue
		}
		l.sess = sess
		retries := l.tracker.Requeue()
		l.s.cfg.Metrics.Retries.Add(float64(len(retries)))
		cut := false // a resend failed: what the session holds is not a whole transaction
		for _, r := range retries {
			ev := r.Payload.(*decoder.Event)
			if ie := l.deadLetterable(r.Err); ie != nil {
				if ev.DeadLetter != nil {
					return fmt.Errorf("the dead letter for a row could not be published either: %w", r.Err)
				}
				// Found by the sink (a repeated id, too large for the server).
				*ev = l.s.cfg.Decoder.DeadLetter(ev, ie)
				l.deadLettered(ie, ev.Subject)
			}
			l.send(r.Ticket, ev)
			if n, _ := l.tracker.Failures(); n > 0 {
				l.tracker.FailPending(errAbandoned) // nothing after a failure can be stored
				cut = true
				break
			}
		}
		// The events of the transaction still being read stay with a
		// batching session until its commit: wait for those before them.
		open := len(retries)
		for l.txLSN != 0 && open > 0 && retries[open-1].Payload.(*decoder.Event).CommitLSN == l.txLSN {
			open--
		}
		if open == len(retries) && !cut {
			l.sess.EndTransaction()
		}
		for {
			wctx, cancel := context.WithDeadline(ctx, l.nextStatus)
			var err error
			if open < len(retries) {
				err = l.tracker.WaitResolvedBefore(wctx, retries[open].Ticket)
			} else {
				err = l.tracker.WaitResolved(wctx)
			}
			cancel()
			if err == nil {
				break
			}
			if ctx.Err() != nil {
				return ctx.Err()
			}
			if err := l.sendStatus(false); err != nil {
				return err
			}
		}
		if failed, cause = l.tracker.Failures(); failed == 0 {
			l.log.Info().Int("attempt", attempt).Msg("republished; resuming")
			l.s.setState(metrics.StateStreaming)
			l.lastRecv = time.Now()
			return nil
		}
	}
}

// openSession opens a sink session while keeping status updates flowing
// (exactly-once mode reads the stream first, which may take a while).
func (l *loop) openSession(ctx context.Context) (Session, error) {
	type result struct {
		s   Session
		err error
	}
	done := make(chan result, 1)
	go func() { s, err := l.s.sink.Open(ctx, l.source); done <- result{s, err} }()
	for {
		select {
		case r := <-done:
			return r.s, r.err
		case <-time.After(time.Until(l.nextStatus)):
			if err := l.sendStatus(false); err != nil {
				r := <-done
				if r.s != nil {
					_ = r.s.Close(context.WithoutCancel(ctx))
				}
				return nil, err
			}
		}
	}
}

// closeSession waits up to timeout for the sink session's acks, sending
// status updates meanwhile, then fails whatever is still in flight. It
// returns only once the session is closed; a status update that fails
// (the connection died) stops the updates and is returned.
func (l *loop) closeSession(ctx context.Context, timeout time.Duration) error {
	dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), timeout)
	defer cancel()
	// A stop while waiting gets --shutdown-timeout, not the whole timeout.
	stopAfter := context.AfterFunc(ctx, func() { time.AfterFunc(l.s.cfg.ShutdownTimeout, cancel) })
	defer stopAfter()
	done := make(chan error, 1)
	go func() { done <- l.sess.Close(dctx) }()
	var statusErr error
	for {
		var tick <-chan time.Time
		if statusErr == nil {
			tick = time.After(time.Until(l.nextStatus))
		}
		select {
		case err := <-done:
			if err != nil {
				l.log.Warn().Err(err).Msg("gave up waiting for acks")
			}
			l.tracker.FailPending(errAbandoned)
			return statusErr
		case <-tick:
			statusErr = l.sendStatus(false)
		}
	}
}

// idle waits until t (or ctx ends) while keeping status updates flowing.
func (l *loop) idle(ctx context.Context, t time.Time) error {
	for {
		next := l.nextStatus
		if t.Before(next) {
			next = t
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(time.Until(next)):
		}
		if !time.Now().Before(t) {
			return nil
		}
		if err := l.sendStatus(false); err != nil {
			return err
		}
	}
}

// sendStatus confirms the tracker's safe LSN in all three positions.
func (l *loop) sendStatus(replyRequested bool) error {
	safe := l.tracker.Safe()
	err := pglogrepl.SendStandbyStatusUpdate(context.Background(), l.conn, pglogrepl.StandbyStatusUpdate{
		WALWritePosition: safe, WALFlushPosition: safe, WALApplyPosition: safe, ReplyRequested: replyRequested,
	})
	if err != nil {
		return fmt.Errorf("send standby status: %w", err)
	}
	if safe != l.sent {
		l.log.Debug().Str("lsn", safe.String()).Msg("confirmed")
		l.sent = safe
	}
	l.s.sent.Store(uint64(safe))
	l.s.cfg.Metrics.ConfirmedLSN.Set(float64(safe))
	events, _ := l.tracker.InFlight()
	l.s.cfg.Metrics.InFlight.Set(float64(events))
	l.nextStatus = time.Now().Add(l.s.cfg.StatusInterval)
	return nil
}

// finish ends the session: it stops reading, waits (bounded) for in-flight
// acks, confirms what is safe, and returns the session's error.
func (l *loop) finish(ctx context.Context, runErr error) error {
	// Bound every write of the shutdown path: the connection may be dead.
	_ = l.conn.Conn().SetDeadline(time.Now().Add(l.s.cfg.ShutdownTimeout + 2*time.Second))
	if err := l.closeSession(ctx, l.s.cfg.ShutdownTimeout); err != nil && runErr == nil {
		runErr = err
	}
	l.tracker.Close()
	if err := l.sendStatus(false); err != nil && runErr == nil {
		l.log.Warn().Err(err).Msg("final standby status not sent")
	}
	events, _ := l.tracker.InFlight()
	l.log.Info().Str("confirmed_lsn", l.tracker.Safe().String()).Int("unacked", events).Msg("replication session stopped")
	if ctx.Err() != nil && (runErr == nil || errors.Is(runErr, context.Canceled)) {
		return nil
	}
	return runErr
}
