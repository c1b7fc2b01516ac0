// Package eventually is the tests' one way to wait for a condition: poll it
// in the calling goroutine (so it races with nothing and leaves no goroutine
// behind) at a growing interval, until it holds or a deadline passes.
//
// Tests synchronise on events (channels, hooks) where the code under test
// offers them; eventually is for what can only be observed from outside: a
// state another process or a real host reaches, a counter another
// goroutine moves.
package eventually
