package replication

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"
	"github.com/jetbox-dev/jetbox/checkpoint"
	"github.com/jetbox-dev/jetbox/decoder"
	"github.com/rs/zerolog"
)

// loop is the state of one session's receive loop. Only its goroutine touches conn.
type loop struct {
	s       *Streamer
	conn    *pgconn.PgConn
	log     zerolog.Logger
	tracker *checkpoint.Tracker[*decoder.Event]
	dec     *decoder.Decoder
	sess    PublishSession
	source  string
	start   pglogrepl.LSN // the slot's confirmed position when the session started
	replay  *tipReplay    // nil: the slot does not replay the stream's tip

	nextStatus time.Time
	deadline   time.Time // read deadline currently set on the socket
	lastRecv   time.Time
	sent       pglogrepl.LSN
	txLSN      pglogrepl.LSN // commit LSN of the transaction being read, once it has events; 0 otherwise
	gate       *recoveryGate // on a standby: holds back what a promotion would mislabel; nil otherwise
	slots      *standbyGate  // --wait-for-standby-slots: holds back what the standbys lack; nil otherwise
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
	// now: the clock, read once per message (twice showed as 2-6% of jetbox's
	// CPU in catch-up profiles), when the last one arrived. After a handle that
	// blocked it is stale until the next message, or until the read times
	// out at once on the deadline (nextStatus) that passed meanwhile.
	now := l.lastRecv
	for {
		if n, err := l.tracker.Failures(); n > 0 {
			if err := l.republish(ctx, n, err); err != nil {
				return err
			}
			now = time.Now()
		}
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
		if ok, err := l.monitorSignal(); ok {
			return err
		}
		msg, err := l.conn.ReceiveMessage(context.Background())
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			if pgconn.Timeout(err) {
				now = time.Now()
				l.deadline = time.Time{} // the socket may hold a deadline in the past
				if since := time.Since(l.lastRecv); since > l.s.cfg.Timeout {
					return fmt.Errorf("no message from postgres for %s (network cut or half-open connection): reconnecting", since.Round(time.Second))
				}
				continue
			}
			return fmt.Errorf("receive replication message: %w", err)
		}
		now = time.Now()
		l.lastRecv = now
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
			if err := l.replay.walEnd(ka.ServerWALEnd); err != nil {
				return l.historyBreak(err)
			}
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
			return l.decodeFailed(err)
		}
		switch msg.Kind {
		case decoder.KindEvent:
			if msg.Partition != "" {
				l.log.Warn().Str("partition", msg.Partition).Str("table", l.s.cfg.qualifiedTable()).Str("fix", viaRootFix(l.s.cfg)).
					Msg("pgoutput names outbox rows after the partition they are stored in (the publication has publish_via_partition_root off): jetbox reads them as outbox rows; run the fix")
			}
			if l.s.cfg.StampDecoded {
				msg.Event.Decoded = l.lastRecv // this message's receive time (one clock read per message)
				msg.Event.WALSent = xld.ServerTime
			}
			if msg.Event.DeadLetter != nil {
				l.deadLettered(msg.Event.DeadLetter, msg.Event.Subject)
			}
			if err := l.replay.event(msg.Event.CommitLSN, msg.Event.TxIndex, msg.Event.ID); err != nil {
				return l.historyBreak(err)
			}
			if err := l.gate.pass(ctx, uint64(msg.Event.CommitLSN)); err != nil {
				return err
			}
			if err := l.slots.pass(ctx, msg.Event.CommitLSN, l.whileBlocked); err != nil {
				return err
			}
			l.txLSN = msg.Event.CommitLSN
			return l.publish(ctx, &msg.Event)
		case decoder.KindCommit:
			if err := l.replay.commit(msg.CommitLSN); err != nil {
				return l.historyBreak(err)
			}
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

// decodeFailed handles an error of the decoder. A row that cannot be
// published (--on-invalid=stop) is skipped when the stream already holds
// it: an earlier run under --on-invalid=dead-letter stored its dead letter
// (or, before a configuration change made it invalid, the row) and was
// stopped before the slot confirmed it, so the slot replays it. Anything
// else stops the session.
func (l *loop) decodeFailed(err error) error {
	var ie *decoder.InvalidEventError
	hs, ok := l.sess.(HeldSkipper)
	if !errors.As(err, &ie) || !ok || !hs.SkipHeld(ie.LSN, ie.TxIndex) {
		return err
	}
	if err := l.replay.invalid(ie.LSN, ie.TxIndex, ie.ID); err != nil {
		return l.historyBreak(err)
	}
	l.log.Info().Str("event_id", ie.ID).Str("lsn", ie.LSN.String()).Int("tx_index", ie.TxIndex).Str("reason", ie.Code).
		Msg("replay of a row that cannot be published, which the stream already holds (its dead letter, stored by an earlier run): skipped")
	return nil
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

// whileBlocked keeps the session alive while the loop waits without
// reading (the standby slot gate): standby status when due, and the
// monitor's reasons to stop or reconnect.
func (l *loop) whileBlocked() error {
	if !time.Now().Before(l.nextStatus) {
		if err := l.sendStatus(false); err != nil {
			return err
		}
	}
	if ok, err := l.monitorSignal(); ok {
		return err
	}
	l.lastRecv = time.Now() // not reading while blocked: not a sign of a dead server
	return nil
}

// send publishes one tracked event; every outcome resolves its ticket.
func (l *loop) send(ticket checkpoint.Ticket, ev *decoder.Event) {
	tracker := l.tracker // one allocation per event (the closure): the hot path
	err := l.sess.Publish(ev, func(err error) {
		if err == nil {
			tracker.Done(ticket)
		} else {
			tracker.Fail(ticket, publishError(ev, err))
		}
	})
	if err != nil {
		l.tracker.Fail(ticket, publishError(ev, err))
	}
}

// publishError names the event a publish of failed.
func publishError(ev *decoder.Event, err error) error {
	return fmt.Errorf("publish id=%s (transaction %s): %w", ev.ID, ev.CommitLSN, err)
}

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

// historyBreak handles a replay that did not reproduce the stream's tip
// (tipReplay): nothing past the slot's start was confirmed. It stops
// jetbox; with AcceptLostRows the tip is forgotten and the next session
// streams on from the slot, skipping nothing by position against it.
func (l *loop) historyBreak(err error) error {
	err = withSource(err, l.s.cfg)
	var he *HistoryError
	ts, ok := l.s.sink.(TipSource)
	if !l.s.cfg.AcceptLostRows || !ok || !errors.As(err, &he) {
		return err
	}
	l.log.Warn().Str("case", he.Case).Str("after_commit_time", he.Tip.CommitTime).Str("after_lsn", he.Tip.CommitLSN.String()).
		Str("detail", he.Detail).Msg("--accept-lost-rows: going on; rows committed after this point may be missing from the stream (jetbox repair re-publishes them from the table)")
	ts.Forget(he.Tip, l.start)
	l.s.forgotTip = he.Tip.Seq
	return fmt.Errorf("restarting the session after an accepted history break: %w", errAcceptedBreak)
}

var errAcceptedBreak = errors.New("the stream's tip was forgotten")

// monitorSignal returns the monitor's reason to stop (fatal) or to
// reconnect (restart), when one waits (ok).
func (l *loop) monitorSignal() (ok bool, reason error) {
	select {
	case err := <-l.s.fatal:
		return true, err
	case err := <-l.s.restart:
		return true, err
	default:
		return false, nil
	}
}
