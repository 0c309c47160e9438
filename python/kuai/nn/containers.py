"""ModuleList and Sequential: modules registered under their index ("0", "1", ...)."""

from kuai._kuai.nn import Module


class ModuleList(Module):
    def __init__(self, modules=()):
        super().__init__()
        object.__setattr__(self, "_items", [])
        for m in modules:
            self.append(m)

    def append(self, module):
        setattr(self, str(len(self._items)), module)
        self._items.append(module)
        return self

    def __getitem__(self, i):
        return self._items[i]

    def __len__(self):
        return len(self._items)

    def __iter__(self):
        return iter(self._items)


class Sequential(ModuleList):
    def __init__(self, *modules):
        super().__init__(modules)

    def forward(self, x):
        for m in self._items:
            x = m(x)
        return x
