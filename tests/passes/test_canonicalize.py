"""canonicalize: constant folding and identities, checked on IR text."""

import numpy as np

import attncomp as ac
from attncomp.passes.canonicalize import Canonicalize
from attncomp.passes.dce import DeadCodeElimination

BEFORE = """\
ac.func @f(%x: tensor<T x f32>, %n: tensor<i64>) -> (tensor<T x f32>, tensor<i64>, tensor<i64>) {
  %zero = ac.constant {value = 0.0} : tensor<f32>
  %one = ac.constant {value = 1.0} : tensor<f32>
  %a = ac.add %x, %zero : tensor<T x f32>
  %b = ac.mul %one, %a : tensor<T x f32>
  %two = ac.constant {value = 2} : tensor<i64>
  %three = ac.constant {value = 3} : tensor<i64>
  %six = ac.mul %two, %three : tensor<i64>
  %d = ac.sub %two, %n : tensor<i64>
  %e = ac.neg %d : tensor<i64>
  ac.return %b, %six, %e
}
"""

AFTER = """\
ac.func @f(%x: tensor<T x f32>, %n: tensor<i64>) -> (tensor<T x f32>, tensor<i64>, tensor<i64>) {
  %two = ac.constant {value = 2} : tensor<i64>
  %0 = ac.constant {value = 6} : tensor<i64>
  %1 = ac.sub %n, %two : tensor<i64>
  ac.return %x, %0, %1
}
"""


def test_rules_and_folding():
    module = ac.parse_ir(BEFORE)
    Canonicalize().run(module, [])
    DeadCodeElimination().run(module, [])
    assert str(module) == AFTER
    x = np.arange(4, dtype=np.float32)
    before = ac.interpret(BEFORE, x, np.int64(5))
    after = ac.interpret(AFTER, x, np.int64(5))
    for b, a in zip(before, after):
        np.testing.assert_array_equal(a, b)


def test_a_rule_never_changes_a_type():
    text = """\
ac.func @g(%x: tensor<T x f32>) -> tensor<T x f32> {
  %zero = ac.constant {value = 0.0} : tensor<T x f32>
  %y = ac.add %zero, %x : tensor<T x f32>
  ac.return %y
}
"""
    module = ac.parse_ir(text)
    Canonicalize().run(module, [])
    assert "ac.add" not in str(module)
    broadcast = text.replace("%x: tensor<T x f32>", "%x: tensor<f32>")
    module = ac.parse_ir(broadcast)
    Canonicalize().run(module, [])
    assert "ac.add" in str(module)  # x is 0-d: replacing the add would change the type
