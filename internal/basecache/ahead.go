package basecache

import (
	"context"
	"errors"
	"sync"

	"github.com/digitalocean/go-libvirt"
)

// Work a cold fetch starts ahead of the step that needs it, so that its
// round trips overlap the calls before that step instead of following
// them. Every goroutine here is owned by the cache (c.wg): it ends on its
// own, bounded by the context it was given, and Close waits for it.

// ahead is what a cold fetch starts before it holds its claim (see
// ensure), once a look at the pool said the base must be fetched: the
// upload's connection is dialled and the pool's free space read while
// the claim is taken and the pool looked at again. A nil *ahead has
// nothing started: the fetch does both in its own time.
type ahead struct {
	dial  *dialing
	space func() (uint64, error) // waits for poolAvailable's answer
	stale bool                   // debris was removed since: read the space again
}

// startAhead starts dialling and reading the free space, bounded by ctx.
func (c *Cache) startAhead(ctx context.Context) *ahead {
	space := inBackground(c, func() (uint64, error) { return c.poolAvailable(ctx) })
	return &ahead{dial: c.dialAhead(ctx), space: space}
}

// available returns the pool's free bytes: read ahead when it was and
// nothing was removed from the pool since, else now.
func (c *Cache) available(ctx context.Context, a *ahead) (uint64, error) {
	if a != nil && !a.stale {
		if avail, err := a.space(); err == nil || ctx.Err() != nil {
			return avail, err
		}
		// read ahead under another context and failed: once more now
	}
	return c.poolAvailable(ctx)
}

// dialed returns the dial started ahead (nil when none).
func (a *ahead) dialed() *dialing {
	if a == nil {
		return nil
	}
	return a.dial
}

// end gives up what nobody used: a connection nobody took is closed, and
// the free-space read is waited for; both before end returns.
func (a *ahead) end() {
	a.dial.discard()
	_, _ = a.space()
}

// dialing is a dedicated connection being opened in the background: a
// cold fetch starts dialling the upload's connection as soon as the pool
// says the base must be fetched, so that the connection's SSH and libvirt
// handshakes (TCP, key exchange, authentication, channel, AuthList,
// ConnectOpen: several round trips) overlap the claim, the HTTP request,
// the free-space check and the volume's creation. Exactly one of take
// and discard gets the outcome; discard (and take, when its ctx ends
// first) cancels a dial still under way and closes a connection nobody
// took, before it returns.
type dialing struct {
	res    chan dialResult // capacity 1: the dial's outcome
	cancel context.CancelFunc

	mu      sync.Mutex
	claimed bool // take or discard has been called
}

type dialResult struct {
	dc  Dedicated
	err error
}

// dialAhead starts opening a dedicated connection, bounded by ctx (the
// opening only, as Conn.Dedicated).
func (c *Cache) dialAhead(ctx context.Context) *dialing {
	ctx, cancel := context.WithCancel(ctx)
	d := &dialing{res: make(chan dialResult, 1), cancel: cancel}
	c.wg.Add(1)
	go func() {
		defer c.wg.Done()
		dc, err := c.conn.Dedicated(ctx)
		d.res <- dialResult{dc, err}
	}()
	return d
}

// errDialTaken: take was called twice (a bug: one connection per dial).
var errDialTaken = errors.New("imagecache: a dial ahead was taken twice")

// take waits for the dial and returns its connection (the caller closes
// it) or its error. When ctx ends first it gives the dial up (as discard)
// and returns ctx's error.
func (d *dialing) take(ctx context.Context) (Dedicated, error) {
	d.mu.Lock()
	if d.claimed {
		d.mu.Unlock()
		return nil, errDialTaken
	}
	d.claimed = true
	d.mu.Unlock()
	select {
	case r := <-d.res:
		d.cancel()
		return r.dc, r.err
	case <-ctx.Done():
		d.giveUp()
		return nil, ctx.Err()
	}
}

// discard gives up a dial nobody took (nil, or taken: nothing to do).
func (d *dialing) discard() {
	if d == nil {
		return
	}
	d.mu.Lock()
	claimed := d.claimed
	d.claimed = true
	d.mu.Unlock()
	if !claimed {
		d.giveUp()
	}
}

// giveUp cancels the dial, waits for it to end (promptly: it is bounded
// by the context just canceled) and closes the connection if it opened.
func (d *dialing) giveUp() {
	d.cancel()
	if r := <-d.res; r.dc != nil {
		_ = r.dc.Close()
	}
}

// dedicated returns the connection dialled ahead by d when there is one,
// else opens one now.
func (c *Cache) dedicated(ctx context.Context, d *dialing) (Dedicated, error) {
	if d != nil {
		return d.take(ctx)
	}
	return c.conn.Dedicated(ctx)
}

// closeAside closes dc in the background; the returned channel is closed
// once it is. A dedicated connection's polite close waits for libvirtd's
// answer (a round trip); where nothing needs the connection gone before
// the next calls, they overlap it, and the caller waits for the channel
// before it returns.
func (c *Cache) closeAside(dc Dedicated) <-chan struct{} {
	done := make(chan struct{})
	c.wg.Add(1)
	go func() {
		defer c.wg.Done()
		defer close(done)
		_ = dc.Close()
	}()
	return done
}

// physicalAhead asks for the physical size of volume vol on the shared
// connection in the background (physicalHandle); the returned function
// waits for the answer.
func (c *Cache) physicalAhead(ctx context.Context, vol libvirt.StorageVol) func() (uint64, error) {
	return inBackground(c, func() (uint64, error) { return c.physicalHandle(ctx, vol.Name, &vol) })
}

// pathAhead reads the path of volume vol on the shared connection in the
// background; the returned function waits for the answer.
func (c *Cache) pathAhead(ctx context.Context, vol libvirt.StorageVol) func() (string, error) {
	return inBackground(c, func() (string, error) {
		var path string
		err := c.doHandle(ctx, vol.Name, &vol, func(l Libvirt, v libvirt.StorageVol) error {
			var err error
			path, err = l.StorageVolGetPath(v)
			return err
		})
		if err != nil {
			path = "" // fn may still be running: never read what it writes
		}
		return path, err
	})
}

// inBackground runs call in a goroutine Close waits for (c.wg) and returns
// a function that waits for its answer; the answer is read once and kept.
func inBackground[T any](c *Cache, call func() (T, error)) func() (T, error) {
	type answer struct {
		v   T
		err error
	}
	ch := make(chan answer, 1)
	c.wg.Add(1)
	go func() {
		defer c.wg.Done()
		v, err := call()
		ch <- answer{v, err}
	}()
	var once sync.Once
	var a answer
	return func() (T, error) {
		once.Do(func() { a = <-ch })
		return a.v, a.err
	}
}
