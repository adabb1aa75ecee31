"""Structured-output cases of our own: a user prompt, the pydantic (v2) model its answer must fit, and a valid
instance of it. benchmarks/grammar_engines.py measures grammar engines on them; the server's acceptance tests
send them through the openai client's `parse()` (issue 45).

    import sys; sys.path.insert(0, "benchmarks")
    from json_schemas import CASES            # tuple[SchemaCase, ...]
    for case in CASES:
        case.name, case.prompt, case.model    # str, str, type[BaseModel]
        case.json_schema()                    # model.model_json_schema()
        case.json_schema(strict=True)         # what openai's parse() sends: every property required
        case.example()                        # a valid instance; .model_dump_json() is its compact JSON

What they cover: nested objects (three levels at most), arrays of strings, numbers and objects with minItems
and maxItems, enums (Literal and Enum), integers and floats with bounds, optional fields, `anyOf` over two
models and over types, booleans, `const`, a string pattern. Every string has a maxLength of at most 80, every
array a maxItems of at most 5 and every number both bounds (tests/test_json_schemas.py holds this), so that a
135M model sampling at temperature 1.0 closes the JSON in a few hundred tokens. A float's fraction digits stay
unbounded (JSON numbers): llguidance accepts any number of them, xgrammar cuts them off. Every model forbids
extra properties and roots at an object, as OpenAI's strict mode asks; strings use maxLength, which strict mode
does not list among the keywords it supports (pattern and format).

Not covered: recursive models, `oneOf` / discriminators, `format` strings (llguidance and xgrammar support
different sets), dictionaries with free keys.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

Name = Annotated[str, Field(max_length=40)]
Text = Annotated[str, Field(max_length=80)]
Digit = Annotated[int, Field(ge=0, le=9)]


@dataclass(frozen=True)
class SchemaCase:
    """One structured-output request: its user prompt, the model its answer must validate against and a valid
    instance (`data`, hand-written; `example()` validates it)."""

    name: str
    prompt: str
    model: type[BaseModel]
    data: Mapping[str, Any] = field(compare=False)

    def example(self) -> BaseModel:
        return self.model.model_validate(self.data)

    def json_schema(self, strict: bool = False) -> dict[str, Any]:
        """The model's JSON schema; `strict`: as the openai client sends it (`parse()`, `pydantic_function_tool`):
        every property required, a default of None dropped (optional fields become required and nullable)."""
        if not strict:
            return self.model.model_json_schema()
        import openai

        return openai.pydantic_function_tool(self.model)["function"]["parameters"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")  # additionalProperties: false


class Unit(enum.Enum):
    GRAM = "g"
    MILLILITRE = "ml"
    PIECE = "piece"
    SPOON = "tbsp"


class Priority(enum.Enum):
    LOW = "low"
    MEDIUM = "medium"
    HIGH = "high"


class Genre(enum.Enum):
    FICTION = "fiction"
    SCIENCE = "science"
    HISTORY = "history"
    POETRY = "poetry"
    FANTASY = "fantasy"


class Language(enum.Enum):
    ENGLISH = "en"
    FRENCH = "fr"
    GERMAN = "de"
    SPANISH = "es"
    JAPANESE = "ja"


class Habitat(enum.Enum):
    FOREST = "forest"
    OCEAN = "ocean"
    DESERT = "desert"
    GRASSLAND = "grassland"
    ARCTIC = "arctic"


class Address(_Strict):
    street: Text
    city: Name
    postal_code: str = Field(max_length=10)
    country: Name


class Person(_Strict):
    name: Name
    age: int = Field(ge=0, le=130)
    email: Text | None = None
    address: Address


class CalendarEvent(_Strict):
    title: Text
    day: str = Field(max_length=10, pattern=r"^[0-9]{4}-[0-9]{2}-[0-9]{2}$")
    start_hour: int = Field(ge=0, le=23)
    duration_minutes: int = Field(ge=5, le=480)
    attendees: list[Name] = Field(max_length=5)
    location: Text | None = None


class ProductReview(_Strict):
    product: Name
    rating: int = Field(ge=1, le=5)
    pros: list[Text] = Field(max_length=3)
    cons: list[Text] = Field(max_length=3)
    would_recommend: bool


class Ingredient(_Strict):
    name: Name
    quantity: float = Field(ge=0, le=1000)
    unit: Unit


class Recipe(_Strict):
    name: Name
    servings: int = Field(ge=1, le=12)
    ingredients: list[Ingredient] = Field(min_length=1, max_length=5)
    steps: list[Text] = Field(min_length=1, max_length=5)
    vegetarian: bool


class WeatherReport(_Strict):
    city: Name
    temperature_c: float = Field(ge=-60, le=60)
    condition: Literal["sunny", "cloudy", "rain", "snow", "fog"]
    humidity_percent: int = Field(ge=0, le=100)
    wind_kph: float = Field(ge=0, le=300)


class Book(_Strict):
    title: Text
    author: Name
    year: int = Field(ge=1450, le=2030)
    genres: list[Genre] = Field(min_length=1, max_length=3)


class Color(_Strict):
    red: int = Field(ge=0, le=255)
    green: int = Field(ge=0, le=255)
    blue: int = Field(ge=0, le=255)
    name: Name | None = None


class FeatureFlag(_Strict):
    key: Name
    enabled: bool
    rollout_percent: int = Field(ge=0, le=100)


class Card(_Strict):
    kind: Literal["card"]
    last_four: str = Field(max_length=4, pattern=r"^[0-9]{4}$")
    expiry_month: int = Field(ge=1, le=12)


class BankTransfer(_Strict):
    kind: Literal["bank_transfer"]
    iban: str = Field(max_length=34)


class Payment(_Strict):
    amount: float = Field(ge=0, le=10000)
    currency: Literal["USD", "EUR", "GBP", "JPY"]
    method: Card | BankTransfer  # anyOf over two models


class Setting(_Strict):
    key: Name
    value: Annotated[int, Field(ge=-1000, le=1000)] | bool | Text  # anyOf over types


class Point(_Strict):
    x: float = Field(ge=-100, le=100)
    y: float = Field(ge=-100, le=100)


class Polygon(_Strict):
    label: Name
    points: list[Point] = Field(min_length=3, max_length=5)


class TodoItem(_Strict):
    title: Text
    done: bool
    priority: Priority


class TodoList(_Strict):
    owner: Name
    items: list[TodoItem] = Field(min_length=1, max_length=5)


class Actor(_Strict):
    name: Name
    role: Name


class Movie(_Strict):
    title: Text
    year: int = Field(ge=1888, le=2030)
    rating: float = Field(ge=0, le=10)
    cast: list[Actor] = Field(max_length=3)


class Sentiment(_Strict):
    label: Literal["positive", "negative", "neutral"]
    confidence: float = Field(ge=0, le=1)


class Translation(_Strict):
    source_language: Language
    target_language: Language
    text: Text


class OrderLine(_Strict):
    sku: str = Field(max_length=12)
    quantity: int = Field(ge=1, le=99)


class ShippingOrder(_Strict):
    order_id: int = Field(ge=1, le=999999)
    lines: list[OrderLine] = Field(min_length=1, max_length=5)
    shipping_address: Address
    express: bool


class Executive(_Strict):
    name: Name
    age: int = Field(ge=18, le=100)


class Company(_Strict):
    name: Name
    founded: int = Field(ge=1800, le=2030)
    headquarters: Address
    ceo: Executive
    employees: int = Field(ge=1, le=1000000)


class QuizQuestion(_Strict):
    question: Text
    choices: list[Text] = Field(min_length=2, max_length=4)
    answer_index: int = Field(ge=0, le=3)


class FlightBooking(_Strict):
    origin: str = Field(max_length=3, pattern=r"^[A-Z]{3}$")
    destination: str = Field(max_length=3, pattern=r"^[A-Z]{3}$")
    passengers: int = Field(ge=1, le=9)
    cabin: Literal["economy", "premium", "business", "first"]
    return_day: str | None = Field(default=None, max_length=10)


class Coordinates(_Strict):
    latitude: float = Field(ge=-90, le=90)
    longitude: float = Field(ge=-180, le=180)
    label: Name | None = None


class Grid(_Strict):
    rows: list[Annotated[list[Digit], Field(min_length=1, max_length=3)]] = Field(min_length=1, max_length=3)


class Animal(_Strict):
    species: Name
    legs: int = Field(ge=0, le=8)
    can_fly: bool
    habitat: Habitat


class Circle(_Strict):
    shape: Literal["circle"]
    radius: float = Field(ge=0, le=100)


class Rectangle(_Strict):
    shape: Literal["rectangle"]
    width: float = Field(ge=0, le=100)
    height: float = Field(ge=0, le=100)


class Drawing(_Strict):
    title: Name
    shapes: list[Circle | Rectangle] = Field(min_length=1, max_length=4)


class Employee(_Strict):
    name: Name
    title: Name
    manager: Executive | None = None  # an optional nested object


class InvoiceLine(_Strict):
    description: Text
    amount: float = Field(ge=0, le=10000)


class Invoice(_Strict):
    number: str = Field(max_length=16)
    lines: list[InvoiceLine] = Field(min_length=1, max_length=5)
    paid: bool
    currency: Literal["USD", "EUR", "GBP"]


_ADDRESS = {"street": "12 Rue de la Paix", "city": "Paris", "postal_code": "75002", "country": "France"}

CASES: tuple[SchemaCase, ...] = (
    SchemaCase("person", "Invent a person with a home address. Answer in JSON.", Person,
               {"name": "Ada Lovelace", "age": 36, "email": "ada@example.com", "address": _ADDRESS}),
    SchemaCase("calendar_event", "Create a calendar event for a team meeting next Tuesday, as JSON.", CalendarEvent,
               {"title": "Sprint planning", "day": "2026-12-01", "start_hour": 10, "duration_minutes": 60,
                "attendees": ["Ana", "Bo", "Chen"], "location": None}),
    SchemaCase("product_review", "Write a short review of a pair of running shoes as JSON.", ProductReview,
               {"product": "Trail runner 2", "rating": 4, "pros": ["Light", "Good grip on mud"],
                "cons": ["Narrow toe box"], "would_recommend": True}),
    SchemaCase("recipe", "Give me a simple pancake recipe in JSON.", Recipe,
               {"name": "Pancakes", "servings": 4,
                "ingredients": [{"name": "flour", "quantity": 200, "unit": "g"},
                                {"name": "milk", "quantity": 300, "unit": "ml"},
                                {"name": "egg", "quantity": 2, "unit": "piece"}],
                "steps": ["Whisk everything into a smooth batter.", "Fry ladlefuls in a hot pan."],
                "vegetarian": True}),
    SchemaCase("weather_report", "Report today's weather in Oslo as JSON.", WeatherReport,
               {"city": "Oslo", "temperature_c": -3.5, "condition": "snow", "humidity_percent": 80, "wind_kph": 12.0}),
    SchemaCase("book", "Describe a classic novel as JSON.", Book,
               {"title": "Frankenstein", "author": "Mary Shelley", "year": 1818, "genres": ["fiction", "science"]}),
    SchemaCase("color", "Pick a color for a website's buttons and give it as JSON.", Color,
               {"red": 30, "green": 144, "blue": 255, "name": "dodger blue"}),
    SchemaCase("feature_flag", "Define a feature flag for a new checkout page, as JSON.", FeatureFlag,
               {"key": "new_checkout", "enabled": True, "rollout_percent": 25}),
    SchemaCase("payment", "Record a card payment of 42.50 euros as JSON.", Payment,
               {"amount": 42.5, "currency": "EUR", "method": {"kind": "card", "last_four": "4242",
                                                             "expiry_month": 9}}),
    SchemaCase("setting", "Give one configuration setting for a text editor as JSON.", Setting,
               {"key": "tab_width", "value": 4}),
    SchemaCase("polygon", "Describe a triangle by its corner points as JSON.", Polygon,
               {"label": "triangle", "points": [{"x": 0.0, "y": 0.0}, {"x": 4.0, "y": 0.0}, {"x": 0.0, "y": 3.0}]}),
    SchemaCase("todo_list", "Make a to-do list for moving house, as JSON.", TodoList,
               {"owner": "Sam", "items": [{"title": "Book a van", "done": False, "priority": "high"},
                                          {"title": "Pack the books", "done": True, "priority": "medium"}]}),
    SchemaCase("movie", "Describe a famous science-fiction film as JSON.", Movie,
               {"title": "Alien", "year": 1979, "rating": 8.5,
                "cast": [{"name": "Sigourney Weaver", "role": "Ripley"}]}),
    SchemaCase("sentiment", "Classify the sentiment of: 'The food was cold and late.' Answer in JSON.", Sentiment,
               {"label": "negative", "confidence": 0.9}),
    SchemaCase("translation", "Translate 'good morning' into French, as JSON.", Translation,
               {"source_language": "en", "target_language": "fr", "text": "bonjour"}),
    SchemaCase("shipping_order", "Create a shipping order for two items as JSON.", ShippingOrder,
               {"order_id": 1042, "lines": [{"sku": "MUG-01", "quantity": 2}, {"sku": "TEA-10", "quantity": 1}],
                "shipping_address": _ADDRESS, "express": False}),
    SchemaCase("company", "Describe a made-up software company as JSON.", Company,
               {"name": "Acme Software", "founded": 1999, "headquarters": _ADDRESS,
                "ceo": {"name": "Jo Park", "age": 51}, "employees": 250}),
    SchemaCase("quiz_question", "Write one multiple-choice geography question as JSON.", QuizQuestion,
               {"question": "What is the capital of Japan?", "choices": ["Kyoto", "Tokyo", "Osaka"],
                "answer_index": 1}),
    SchemaCase("flight_booking", "Book a flight from Lisbon to Berlin for two people, as JSON.", FlightBooking,
               {"origin": "LIS", "destination": "BER", "passengers": 2, "cabin": "economy", "return_day": None}),
    SchemaCase("coordinates", "Give the coordinates of the Eiffel Tower as JSON.", Coordinates,
               {"latitude": 48.8584, "longitude": 2.2945, "label": "Eiffel Tower"}),
    SchemaCase("grid", "Make a small grid of digits for a puzzle, as JSON.", Grid,
               {"rows": [[1, 2, 3], [4, 5, 6], [7, 8, 9]]}),
    SchemaCase("animal", "Describe a penguin as JSON.", Animal,
               {"species": "Emperor penguin", "legs": 2, "can_fly": False, "habitat": "arctic"}),
    SchemaCase("drawing", "Describe a drawing made of a circle and a rectangle, as JSON.", Drawing,
               {"title": "Sun over a house", "shapes": [{"shape": "circle", "radius": 2.5},
                                                       {"shape": "rectangle", "width": 10.0, "height": 6.0}]}),
    SchemaCase("employee", "Describe an employee and their manager as JSON.", Employee,
               {"name": "Lee Wong", "title": "Engineer", "manager": {"name": "Jo Park", "age": 51}}),
    SchemaCase("invoice", "Write an invoice for two hours of consulting, as JSON.", Invoice,
               {"number": "INV-2026-001", "lines": [{"description": "Consulting, 2 hours", "amount": 300.0}],
                "paid": False, "currency": "USD"}),
)
