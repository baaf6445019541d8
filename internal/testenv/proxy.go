package testenv

import (
	"bytes"
	"net"
	"sync"
	"testing"
	"time"
)

// Proxy forwards TCP connections from a loopback port to a target. Cut closes
// every open connection (both ends see a reset/EOF, like a dropped link).
// Pause stops forwarding bytes while keeping sockets open (a blackhole: the
// peers see a half-open connection) until Resume. Delay adds latency to
// every byte; PauseOn pauses when a given byte string passes.
type Proxy struct {
	t      testing.TB
	ln     net.Listener
	target string

	mu     sync.Mutex
	conns  map[net.Conn]struct{}
	paused bool
	resume chan struct{}
	delay  time.Duration
	holdOn []byte
	// Addr is host:port to dial instead of the target.
	Addr string
}

// StartProxy listens on a free loopback port and forwards to target.
func StartProxy(t testing.TB, target string) *Proxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &Proxy{t: t, ln: ln, target: target, conns: map[net.Conn]struct{}{}, resume: make(chan struct{}), Addr: ln.Addr().String()}
	go p.accept()
	t.Cleanup(func() { ln.Close(); p.Resume(); p.Cut() })
	return p
}

// Port is the proxy's port.
func (p *Proxy) Port() int { return p.ln.Addr().(*net.TCPAddr).Port }

func (p *Proxy) accept() {
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		u, err := net.Dial("tcp", p.target)
		if err != nil {
			c.Close()
			continue
		}
		p.mu.Lock()
		p.conns[c], p.conns[u] = struct{}{}, struct{}{}
		p.mu.Unlock()
		go p.pipe(c, u)
		go p.pipe(u, c)
	}
}

type chunk struct {
	data []byte
	at   time.Time
	err  error
}

// pipe copies src to dst; a second goroutine writes, so that a delay holds
// each chunk back by the delay from its arrival (latency, not a rate cap).
func (p *Proxy) pipe(dst, src net.Conn) {
	chunks := make(chan chunk, 1024)
	go func() {
		defer close(chunks)
		for {
			buf := make([]byte, 32<<10)
			n, err := src.Read(buf)
			if n > 0 {
				p.mu.Lock()
				hold := p.holdOn != nil && bytes.Contains(buf[:n], p.holdOn)
				p.mu.Unlock()
				if hold {
					p.Pause()
				}
				chunks <- chunk{data: buf[:n], at: time.Now()}
			}
			if err != nil {
				chunks <- chunk{err: err}
				return
			}
		}
	}()
	defer func() {
		dst.Close()
		src.Close()
		p.mu.Lock()
		delete(p.conns, dst)
		delete(p.conns, src)
		p.mu.Unlock()
		for range chunks { // let the reader end
		}
	}()
	for c := range chunks {
		p.waitResumed() // a blackhole delivers no FIN either
		p.mu.Lock()
		d := p.delay
		p.mu.Unlock()
		if wait := time.Until(c.at.Add(d)); wait > 0 {
			time.Sleep(wait)
		}
		if c.err != nil {
			return
		}
		if _, werr := dst.Write(c.data); werr != nil {
			return
		}
	}
}

// Delay holds every byte back by d (in each direction) from now on; 0 ends it.
func (p *Proxy) Delay(d time.Duration) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.delay = d
}

// PauseOn pauses the proxy (see Pause) as soon as a chunk containing b
// arrives from either side, before forwarding it; nil turns it off.
func (p *Proxy) PauseOn(b []byte) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.holdOn = b
}

func (p *Proxy) waitResumed() {
	p.mu.Lock()
	paused, ch := p.paused, p.resume
	p.mu.Unlock()
	if paused {
		<-ch
	}
}

// Cut closes every connection open through the proxy; new ones are accepted.
func (p *Proxy) Cut() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for c := range p.conns {
		c.Close()
	}
}

// Pause stops forwarding (bytes are held, sockets stay open, and a side
// that closes is not seen closing by the other until Resume or Cut).
func (p *Proxy) Pause() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.paused {
		p.paused = true
		p.resume = make(chan struct{})
	}
}

// Resume forwards again.
func (p *Proxy) Resume() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.paused {
		p.paused = false
		close(p.resume)
	}
}

// Paused reports whether the proxy holds bytes back (Pause or PauseOn).
func (p *Proxy) Paused() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.paused
}
