package replication

import (
	"context"
	"fmt"
	"time"

	"github.com/cenkalti/backoff/v5"
)

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
		l.s.setState(StateRepublishing)
		// The sink's publish timeout bounds the wait; the cap guards against a
		// client that never resolves a future.
		if err := l.closeSession(ctx, 2*time.Minute); err != nil {
			return err
		}
		wait := bo.NextBackOff()
		l.log.Warn().Err(cause).Int("failed", failed).Int("attempt", attempt).Stringer("backoff", wait).
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
			ev := r.Payload
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
		for l.txLSN != 0 && open > 0 && retries[open-1].Payload.CommitLSN == l.txLSN {
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
			l.s.setState(StateStreaming)
			l.lastRecv = time.Now()
			return nil
		}
	}
}

// openSession opens a sink session while keeping status updates flowing
// (exactly-once mode reads the stream first, which may take a while).
func (l *loop) openSession(ctx context.Context) (PublishSession, error) {
	type result struct {
		s   PublishSession
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
