package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/jetbox-dev/jetbox/sink/format"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/synadia-io/orbit.go/jetstreamext"
)

// headerSet is which headers a raw message carries besides Nats-Msg-Id.
type headerSet int

const (
	idOnly        headerSet = iota // Nats-Msg-Id alone
	jetboxHeaders                  // the Jetbox-* headers jetbox adds to every event
	jetboxGuarded                  // those plus exactly-once's order guard: the expected last sequence and id
	guardedStream                  // those plus Nats-Expected-Stream (what jetbox sent on every message before)
)

// rawMsg builds the i-th raw message: the subject and payload size of the
// outbox events, Nats-Msg-Id = a uuid-shaped id, and the headers of set.
func rawMsg(stream, prefix string, i int, payload []byte, set headerSet) *nats.Msg {
	id := rawID(i)
	m := &nats.Msg{Subject: prefix + ".order.OrderPlaced", Data: payload, Header: nats.Header{jetstream.MsgIDHeader: {id}}}
	if set == idOnly {
		return m
	}
	h := m.Header
	h[format.HeaderAggregateType] = []string{"order"}
	h[format.HeaderAggregateID] = []string{strconv.Itoa(i)}
	h[format.HeaderEventType] = []string{"OrderPlaced"}
	h[format.HeaderCommitLSN] = []string{"0/" + strconv.FormatUint(uint64(0x1000000+i/100*0x8000), 16)}
	h[format.HeaderCommitTime] = []string{time.Now().UTC().Format("2006-01-02T15:04:05.000000000Z")}
	h[format.HeaderTxIndex] = []string{strconv.Itoa(i % 100)}
	h[format.HeaderSource] = []string{"7441234567890123456/1/bench/jetbox"}
	if set == guardedStream {
		h[jetstream.ExpectedStreamHeader] = []string{stream}
	}
	if set >= jetboxGuarded {
		h[jetstream.ExpectedLastSeqHeader] = []string{strconv.Itoa(i)}
		if i > 0 {
			h[jetstream.ExpectedLastMsgIDHeader] = []string{rawID(i - 1)}
		}
	}
	return m
}

func rawID(i int) string { return fmt.Sprintf("00000000-0000-4000-8000-%012d", i) }

// rawPayload is a JSON payload of size bytes.
func rawPayload(size int) []byte {
	return []byte(`{"n": 1, "pad": "` + string(bytes.Repeat([]byte("x"), size-19)) + `"}`)
}

// rawPublish measures plain JetStream: n messages published asynchronously
// into a fresh stream with at most cfg.Window in flight (the way jetbox's sink
// pipelines), the clock running until every one is acked.
func (b *bench) rawPublish(ctx context.Context, name, stream string, n int, set headerSet) *throughput {
	return b.rawPublishSized(ctx, name, stream, n, set, b.cfg.PayloadSize)
}

// rawPublishSized is rawPublish with payloads of size bytes.
func (b *bench) rawPublishSized(ctx context.Context, name, stream string, n int, set headerSet, size int) *throughput {
	res := &throughput{Name: name, Events: n}
	prefix := strings.ToLower(stream)
	if err := b.createStream(ctx, stream, prefix, false); err != nil {
		res.Err = err
		return res
	}
	b.log.Info().Str("workload", name).Int("messages", n).Msg("publishing")
	payload := rawPayload(size)
	res.Err = b.measurePublish(ctx, res, stream, func() error {
		return b.publishWindowed(ctx, n, func(i int) *nats.Msg { return rawMsg(stream, prefix, i, payload, set) })
	})
	return res
}

// measurePublish runs publish (in the bench process) and fills in res.
func (b *bench) measurePublish(ctx context.Context, res *throughput, stream string, publish func() error) error {
	if err := b.settle(ctx); err != nil {
		return err
	}
	m, err := b.startMeter(nil)
	if err != nil {
		return err
	}
	start := time.Now()
	if err := publish(); err != nil {
		return err
	}
	res.Elapsed = time.Since(start)
	if res.CPU, err = m.read(nil, true); err != nil {
		return err
	}
	if res.Host, err = m.hostUsage(); err != nil {
		return err
	}
	first, last, err := b.storedSpan(ctx, stream, 1, uint64(res.Events))
	if err != nil {
		return err
	}
	res.Span = last.Sub(first)
	if got, err := b.streamMsgs(ctx, stream); err != nil || got != uint64(res.Events) {
		return fmt.Errorf("stream %s holds %d messages, want %d (%v)", stream, got, res.Events, err)
	}
	b.log.Info().Str("workload", res.Name).Float64("events_per_s", res.rate()).Msg("published")
	return nil
}

// publishWindowed publishes msg(0..n-1) asynchronously with at most
// cfg.Window unacked, and returns once all are acked or one failed.
func (b *bench) publishWindowed(ctx context.Context, n int, msg func(i int) *nats.Msg) error {
	window := make(chan jetstream.PubAckFuture, b.cfg.Window)
	acked := make(chan error, 1)
	go func() { acked <- awaitFutures(ctx, window, b.cfg.Timeout) }()
	var err error
	for i := 0; i < n && err == nil; i++ {
		var fut jetstream.PubAckFuture
		if fut, err = b.srv.js.PublishMsgAsync(msg(i)); err == nil {
			select {
			case window <- fut: // blocks while the window is full
			case err = <-acked: // the acker failed: stop
				acked <- err
			}
		}
	}
	close(window)
	return errors.Join(err, <-acked)
}

// awaitFutures waits, in order, for every future sent on window until it is
// closed; it returns the first failure.
func awaitFutures(ctx context.Context, window <-chan jetstream.PubAckFuture, timeout time.Duration) error {
	for fut := range window {
		select {
		case <-fut.Ok():
		case err := <-fut.Err():
			return fmt.Errorf("publish %s: %w", fut.Msg().Header.Get(jetstream.MsgIDHeader), err)
		case <-time.After(timeout):
			return fmt.Errorf("no ack for %s within %s", fut.Msg().Header.Get(jetstream.MsgIDHeader), timeout)
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return nil
}

// fastBatch measures JetStream's fast-ingest batch publishing (nats-server
// 2.14+, a stream with AllowBatchPublish): the server acks every few hundred
// messages instead of each one. n messages with Nats-Msg-Id in one batch,
// for the report only: a server or stream without it is reported as such.
func (b *bench) fastBatch(ctx context.Context, n int) *throughput {
	const stream, prefix = "FAST", "fast"
	flow := jetstreamext.FastPublishFlowControl{Flow: 100, MaxOutstandingAcks: 2, AckTimeout: 30 * time.Second} // the defaults: fastest here
	res := &throughput{Name: "JetStream fast-ingest batch, Nats-Msg-Id (report only)", Events: n,
		Note: fmt.Sprintf("one batch, flow %d, %d acks outstanding", flow.Flow, flow.MaxOutstandingAcks)}
	if err := b.createStream(ctx, stream, prefix, true); err != nil {
		res.Err = fmt.Errorf("not supported by this server: %w", err)
		return res
	}
	b.log.Info().Str("workload", "fast batch").Int("messages", n).Msg("publishing")
	payload := rawPayload(b.cfg.PayloadSize)
	res.Err = b.measurePublish(ctx, res, stream, func() error {
		fp, err := jetstreamext.NewFastPublisher(b.srv.js, flow)
		if err != nil {
			return fmt.Errorf("fast publisher: %w", err)
		}
		for i := range n - 1 {
			if _, err := fp.AddMsg(rawMsg(stream, prefix, i, payload, idOnly)); err != nil {
				return fmt.Errorf("fast batch add %d: %w", i, err)
			}
		}
		if _, err := fp.CommitMsg(ctx, rawMsg(stream, prefix, n-1, payload, idOnly)); err != nil {
			return fmt.Errorf("fast batch commit: %w", err)
		}
		return nil
	})
	return res
}
