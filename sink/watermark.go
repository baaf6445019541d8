package sink

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/jetbox-dev/jetbox/sink/format"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// WatermarkBucket is the JetStream KV bucket where dedup mode keeps, per
// stream and source, the watermark that tells a replay from a repeated id
// once the original message is gone (see the package doc).
const WatermarkBucket = "jetbox_watermarks"

// watermark is the last event of the in-order prefix this jetbox resolved
// (stored, or proved a replay): pos, and the highest stream sequence that
// prefix occupies. Every message of this source stored at or before seq is
// at or before pos; every event at or before pos was stored.
type watermark struct {
	Seq       uint64 `json:"seq"`
	CommitLSN uint64 `json:"commit_lsn"`
	TxIndex   int    `json:"tx_index"`
}

func (w watermark) pos() format.Position {
	return format.Position{CommitLSN: w.CommitLSN, TxIndex: w.TxIndex}
}

// replays is the publisher's memory of what it resolved, across sessions.
type replays struct {
	source   string // the source wm is for
	wm       watermark
	hasWM    bool
	firstSeq uint64                     // the stream's last sequence when this process first opened
	claims   map[uint64]format.Position // stream sequence → the event stored there, after wm.Seq
	kv       jetstream.KeyValue         // nil: not persisted
	key      string
	replicas int // of the stream: the bucket's, if created again
}

// watermarkKey is the bucket key of source's watermark in stream: the
// writer (Origin.Writer, unescaped), so a failover keeps it.
func watermarkKey(stream, source string) string {
	writer := source
	if o, ok := format.ParseOrigin(source); ok {
		writer = o.Writer()
	}
	return base64.RawURLEncoding.EncodeToString([]byte(stream + "\x00" + writer))
}

// loadWatermark opens the bucket (creating it) and reads source's
// watermark, once per source; a failure leaves the watermark unpersisted
// (a replay whose original is gone is then reported as a repeated id).
func (s *Session) loadWatermark(ctx context.Context, replicas int) {
	p := s.p
	p.rmu.Lock()
	defer p.rmu.Unlock()
	r := &p.replays
	if r.claims == nil {
		r.claims = map[uint64]format.Position{}
		r.firstSeq = s.nextSeq
	}
	if r.source != s.source {
		r.source, r.hasWM, r.wm, r.kv = s.source, false, watermark{}, nil
		clear(r.claims)
	}
	if !p.cfg.Delivery.PersistsWatermark() || r.kv != nil {
		return
	}
	r.replicas = replicas
	kv, err := p.watermarkBucket(ctx, replicas)
	if err != nil {
		p.log.Warn().Err(err).Str("bucket", WatermarkBucket).
			Msg("cannot use the watermark bucket: after a restart, a replay whose original message is gone is reported as a repeated id")
		return
	}
	r.kv, r.key = kv, watermarkKey(p.cfg.Stream, s.source)
	e, err := kv.Get(ctx, r.key)
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		return
	}
	var w watermark
	if err == nil {
		err = json.Unmarshal(e.Value(), &w)
	}
	if err != nil {
		p.log.Warn().Err(err).Str("bucket", WatermarkBucket).Msg("cannot read the watermark")
		return
	}
	if !r.hasWM || r.wm.pos().Less(w.pos()) {
		r.wm, r.hasWM = w, true
	}
}

// watermarkBucket opens the bucket, creating it if missing.
func (p *Publisher) watermarkBucket(ctx context.Context, replicas int) (jetstream.KeyValue, error) {
	kv, err := p.js.KeyValue(ctx, WatermarkBucket)
	if errors.Is(err, jetstream.ErrBucketNotFound) {
		kv, err = p.js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: WatermarkBucket, History: 1,
			Description: "jetbox: where each outbox stream's replays end (dedup mode)", Storage: jetstream.FileStorage, Replicas: max(1, replicas)})
		if errors.Is(err, jetstream.ErrBucketExists) {
			kv, err = p.js.KeyValue(ctx, WatermarkBucket)
		}
	}
	return kv, err
}

// advance moves the watermark to pos/seq (the end of an in-order prefix of
// resolved events) and, in dedup mode, stores it before their done calls.
func (s *Session) advance(pos format.Position, seq uint64) error {
	p := s.p
	if !p.cfg.Delivery.Guarded() {
		return nil
	}
	p.rmu.Lock()
	defer p.rmu.Unlock()
	r := &p.replays
	w := r.wm
	if r.hasWM && !w.pos().Less(pos) && seq <= w.Seq {
		return nil
	}
	if !r.hasWM || w.pos().Less(pos) {
		w.CommitLSN, w.TxIndex = pos.CommitLSN, pos.TxIndex
	}
	w.Seq = max(w.Seq, seq)
	if r.kv != nil && r.source == s.source {
		b, _ := json.Marshal(w)
		ctx, cancel := context.WithTimeout(s.ctx, p.cfg.PublishTimeout)
		_, err := r.kv.Put(ctx, r.key, b)
		if errors.Is(err, jetstream.ErrNoStreamResponse) {
			// The bucket was deleted while jetbox ran (a cached handle would
			// fail every ack for ever, and WAL would grow): create it again
			// with this watermark, or go on without one, as a start that
			// cannot use the bucket does.
			err = p.restoreWatermark(ctx, r, b)
		}
		cancel()
		if errors.Is(err, nats.ErrPermissionViolation) {
			return &PermanentError{Err: fmt.Errorf("store the watermark in bucket %s: %w", WatermarkBucket, err),
				Hint: fmt.Sprintf("grant this NATS user publish on $KV.%s.> (dedup mode keeps its watermark there), then restart jetbox; nothing past the last covered event was confirmed", WatermarkBucket)}
		}
		if err != nil {
			return fmt.Errorf("store the watermark in bucket %s: %w", WatermarkBucket, err)
		}
	}
	r.wm, r.hasWM = w, true
	for q := range r.claims {
		if q <= w.Seq {
			delete(r.claims, q)
		}
	}
	return nil
}

// restoreWatermark creates the watermark bucket again and stores b in it;
// when it cannot, the watermark goes unpersisted (r.kv nil). rmu is held.
func (p *Publisher) restoreWatermark(ctx context.Context, r *replays, b []byte) error {
	kv, err := p.watermarkBucket(ctx, r.replicas)
	if err == nil {
		_, err = kv.Put(ctx, r.key, b)
	}
	if err != nil {
		p.log.Warn().Err(err).Str("bucket", WatermarkBucket).
			Msg("the watermark bucket was deleted and cannot be created again: going on without it (after a restart, a replay whose original message is gone is reported as a repeated id)")
		r.kv = nil
		return nil
	}
	p.log.Warn().Str("bucket", WatermarkBucket).Msg("the watermark bucket was deleted while jetbox ran: created it again with the current watermark")
	r.kv = kv
	return nil
}

// claim records that the message at seq is the event at pos; it reports
// false if another event already claimed it.
func (p *Publisher) claim(seq uint64, pos format.Position) bool {
	p.rmu.Lock()
	defer p.rmu.Unlock()
	r := &p.replays
	if r.hasWM && seq <= r.wm.Seq {
		return true
	}
	if c, ok := r.claims[seq]; ok {
		return c == pos
	}
	if r.claims == nil {
		r.claims = map[uint64]format.Position{}
	}
	r.claims[seq] = pos
	return true
}

// provenReplay decides a Duplicate PubAck for the event at pos whose
// original (at seq) is no longer in the stream: it is a replay if pos is at
// or before the watermark, or if the original was stored after the
// watermark (or, without one, by this process) and no other event of ours
// claims it. An original at or before the watermark for an event after it
// is another row's; without a watermark an older original cannot be told
// apart.
func (s *Session) provenReplay(pos format.Position, seq uint64) bool {
	p := s.p
	if !p.cfg.Delivery.Guarded() {
		return false // without the order guard, positions prove nothing
	}
	p.rmu.Lock()
	r := &p.replays
	hasWM := r.hasWM && r.source == s.source
	wm, first := r.wm, r.firstSeq
	p.rmu.Unlock()
	switch {
	case hasWM && !wm.pos().Less(pos):
		return true
	case hasWM && seq <= wm.Seq:
		return false
	case !hasWM && seq <= first:
		return false
	}
	return p.claim(seq, pos)
}
